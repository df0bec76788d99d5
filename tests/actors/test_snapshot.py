"""Tensor snapshots end to end: `serve --snapshot` makes worker rank 0 send the selected
requests' inputs, per-layer hidden states and logits to the snapshot sink, which writes
safetensors files plus index.json; `axonserve snapshot ls|show` and the reader give them back
equal to a transformers forward. A stalled sink costs dropped records, never a stalled engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from conftest import make_tiny_llama
from frontends.server import REPO, serve

from axonserve.actors.snapshot import load_request, read_index
from axonserve.neuron.snapshot import SnapshotRules

PROMPT = list(range(300, 323))  # 23 tokens: several prefill chunks under an 8-token budget
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def tiny3_dir(tmp_path_factory, smollm2_dir) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny3")), smollm2_dir, seed=3, num_hidden_layers=3)


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def index_steps(d: str, request_id: str) -> set[int]:
    try:
        return {r["step"] for r in read_index(d)["records"] if r["request_id"] == request_id}
    except (FileNotFoundError, json.JSONDecodeError):
        return set()


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "axonserve.cli", *args],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_rules_parse_compact_and_json():
    r = SnapshotRules.parse("requests=cmpl-*,abc,steps=0-3,7-;tensors=hidden,logits,layers=1")
    assert r.requests == ("cmpl-*", "abc") and r.steps == ((0, 3), (7, -1))
    assert r.tensors == ("hidden", "logits") and r.layers == ((1, 1),)
    assert r.wants_request("cmpl-9") and r.wants_request("abc") and not r.wants_request("other")
    assert r.wants_step(3) and not r.wants_step(5) and r.wants_step(70)
    assert SnapshotRules.parse('{"requests": "all", "steps": ["0-1"]}') == SnapshotRules(steps=((0, 1),))
    assert SnapshotRules.from_json(r.to_json()) == r
    for bad in ("bogus=1", "steps=3-1", "tensors=weights", "noeq", ""):
        with pytest.raises(ValueError):
            SnapshotRules.parse(bad)


@pytest.mark.timeout(300)
def test_served_snapshots_equal_transformers_hidden_states(tiny3_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    snap = str(tmp_path / "snap")
    args = (
        "--num-kv-blocks",
        "64",
        "--block-size",
        "4",
        "--max-num-batched-tokens",
        "8",
        "--snapshot",
        "requests=snap-*,tensors=inputs,hidden,logits",
        "--snapshot-dir",
        snap,
    )
    with serve(tiny3_dir, *args) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=120) as http:
            for rid in ("snap-1", "other-1"):  # only the first matches the rules
                body = {
                    "model": tiny3_dir,
                    "prompt": PROMPT,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                    "request_id": rid,
                }
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
        wait_for(lambda: index_steps(snap, "snap-1") >= set(range(MAX_TOKENS)), 60, "the sink's records")

    index = read_index(snap)
    assert {r["request_id"] for r in index["records"]} == {"snap-1"}
    assert index["dropped"] == 0
    # chunked prefill: step 0 arrives in several records, each one forward pass
    assert sum(r["step"] == 0 for r in index["records"]) >= 3

    got = load_request(snap, "snap-1")
    out_ids = got["input_ids"].tolist()[len(PROMPT) :]  # the tokens fed back after sampling
    seq = PROMPT + out_ids
    assert got["input_ids"].tolist() == seq and len(seq) == len(PROMPT) + MAX_TOKENS - 1
    assert got["positions"].tolist() == list(range(len(seq)))
    assert got["logits"].shape == (MAX_TOKENS, 49152)

    hf = AutoModelForCausalLM.from_pretrained(tiny3_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([seq]), output_hidden_states=True)
    hs = ref.hidden_states  # [embeddings, layer 0 out, layer 1 out, norm(layer 2 out)]
    for i in range(2):
        torch.testing.assert_close(got[f"hidden.{i}"], hs[i + 1][0], atol=1e-4, rtol=1e-4)
    with torch.inference_mode():
        torch.testing.assert_close(hf.model.norm(got["hidden.2"]), hs[3][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got["logits"], ref.logits[0, len(PROMPT) - 1 :], atol=1e-3, rtol=1e-4)
    # the sampled tokens are the argmax of the captured logits (greedy)
    assert got["logits"][:-1].argmax(-1).tolist() == out_ids

    ls = cli("snapshot", "ls", snap)
    assert ls.returncode == 0, ls.stderr
    lines = ls.stdout.splitlines()
    assert lines[0].split() == ["request", "step", "engine_step", "tensor", "shape", "dtype"]
    assert any(line.split()[:1] == ["snap-1"] and "hidden.2" in line and "x64" in line for line in lines)
    assert any("logits" in line and "1x49152" in line and "float32" in line for line in lines)
    show = cli("snapshot", "show", snap, "snap-1/1/logits")
    assert show.returncode == 0, show.stderr
    assert "snap-1/1/logits" in show.stdout and "shape=[1, 49152]" in show.stdout and "top=" in show.stdout
    missing = cli("snapshot", "show", snap, "nope")
    assert missing.returncode == 2 and "matches" in missing.stderr


@pytest.mark.timeout(300)
async def test_stalled_sink_drops_records_and_never_stalls_serving(tiny_llama_dir, tmp_path):
    from axonserve.actors.supervisor import Supervisor
    from axonserve.config import EngineConfig
    from axonserve.frontends.client import AsyncEngineClient
    from axonserve.protocol.messages import SamplingParams

    snap = str(tmp_path / "snap")
    cfg = EngineConfig(
        model=tiny_llama_dir,
        num_kv_blocks=256,
        block_size=16,
        log_level="warning",
        snapshot=SnapshotRules(tensors=("logits",)).to_json(),
        snapshot_dir=snap,
    )
    sup = Supervisor(cfg, frontend=False)
    await sup.start()
    sink = sup.children["snapshot"].proc
    client = await AsyncEngineClient.connect(sup.addresses.engine, timeout=60)
    os.kill(sink.pid, signal.SIGSTOP)  # the sink reads nothing from now on
    try:
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

        async def one(i: int) -> int:
            n = 0
            async for out in client.generate([400 + i, 401, 402], params):
                assert out.error is None, out.error
                n += len(out.token_ids)
            return n

        counts = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(4))), 240)
        assert counts == [100] * 4  # 400 records of 196 KB each: far beyond the queues
    finally:
        os.kill(sink.pid, signal.SIGCONT)
        client.close()
        await sup.stop("test done")
    index = read_index(snap)
    assert index["dropped"] > 0
    assert 0 < len(index["records"]) < 400


def test_bucketed_steps_capture_the_same_tensors_as_eager_steps(tiny_llama_dir):
    """Neuron bucketing pads the batch; the capture keeps only the request's real rows."""
    import torch

    from axonserve.config import EngineConfig
    from axonserve.neuron.model_runner import ModelRunner
    from axonserve.protocol.messages import CachedRequestData, NewRequestData, SamplingParams, StepPlan

    rules = SnapshotRules.parse("requests=a").to_json()
    params = SamplingParams(temperature=0, max_tokens=4)

    def capture(**kw) -> dict[str, torch.Tensor]:
        runner = ModelRunner(
            EngineConfig(model=tiny_llama_dir, num_kv_blocks=32, block_size=4, max_model_len=256, snapshot=rules, **kw)
        )
        runner.execute(
            StepPlan(
                1,
                new=[
                    NewRequestData("b", [5, 6, 7], 3, [3], 0, params),
                    NewRequestData("a", PROMPT[:11], 11, [0, 1, 2], 0, params),
                ],
                num_scheduled_tokens=[3, 11],
            )
        )
        records = runner.snapshots.take()
        runner.execute(
            StepPlan(2, cached=[CachedRequestData("b"), CachedRequestData("a")], num_scheduled_tokens=[1, 1])
        )
        records += runner.snapshots.take()
        assert [(r.request_id, r.step) for r, _ in records] == [("a", 0), ("a", 1)]
        out: dict[str, list[torch.Tensor]] = {}
        for rec, tensors in records:
            for name, ref in rec.tensors.items():
                out.setdefault(name, []).append(tensors[ref.index - 1])
        return {k: torch.cat(v) for k, v in out.items()}

    eager, bucketed = capture(), capture(bucketing=True)
    assert eager.keys() == bucketed.keys() >= {"input_ids", "positions", "hidden.0", "hidden.1", "logits"}
    assert eager["positions"].tolist() == list(range(12))
    for name in eager:
        torch.testing.assert_close(bucketed[name], eager[name], atol=1e-5, rtol=1e-5)
