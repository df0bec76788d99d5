"""`axonserve bench compare` can run vLLM's server on axonserve's ranks as a peer."""

from __future__ import annotations

from axonserve.bench.compare import ENGINES
from axonserve.bench.servers import REPO, vllm_axonserve_spec, vllm_spec


def test_vllm_axonserve_peer_is_the_vllm_peer_on_our_executor():
    plain = vllm_spec("/venv", "/model", "bench-model", 2, [])
    ours = vllm_axonserve_spec("/venv", "/model", "bench-model", 2, ["--max-num-seqs", "64"])
    assert "vllm+axonserve" in ENGINES and ours.name == "vllm+axonserve"
    i = ours.cmd.index("--distributed-executor-backend")
    assert ours.cmd[i + 1] == "axonserve.frontends.vllm_plugin.executor.AxonExecutor"
    assert ours.cmd[: len(plain.cmd)] == plain.cmd and ours.cmd[-2:] == ["--max-num-seqs", "64"]
    assert ours.env["PYTHONPATH"].split(":")[0] == REPO and ours.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
