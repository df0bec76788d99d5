"""Sequence parallelism on a real 2-rank gloo group: the token-sharded collectives equal the
all-reduce they replace, and a forward that runs sequence-parallel gives the plain
tensor-parallel logits bit for bit (and transformers' within tolerance)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from axonserve.config import EngineConfig

from .conftest import hf_model, make_runner, make_tiny_llama, runner_logits

IDS = [(i * 37 + 11) % 1024 for i in range(23)]
CHUNKS = [13, 1, 9]  # 13 and 9 tokens run sequence-parallel (threshold 8; 13 and 9 pad to even), 1 does not


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(target, *args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=target, args=(r, port, q, *args)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(q.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results


def _collectives_main(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    from axonserve.neuron.parallel import (
        TPInfo,
        init_tensor_parallel,
        tp_all_gather_tokens,
        tp_all_reduce,
        tp_reduce,
        tp_reduce_scatter,
        tp_token_shard,
    )

    torch.set_num_threads(1)
    init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", timeout_s=60)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for t in (1, 7, 8):
            g = torch.Generator().manual_seed(100 * t + rank)  # each rank its own partial sums
            x = torch.randn(t, 6, generator=g).to(dtype)
            want = tp_token_shard(tp_all_reduce(x.clone()))
            got = tp_reduce_scatter(x)
            TPInfo.sequence_parallel = True
            via_layer_hook = tp_reduce(x)
            TPInfo.sequence_parallel = False
            whole = torch.randn(t, 6, generator=torch.Generator().manual_seed(t)).to(dtype)  # the same on both
            shard = tp_token_shard(whole)
            key = f"{dtype}-{t}"
            out[key] = (
                tuple(got.shape),
                got.dtype == dtype,
                torch.equal(got, want),
                torch.equal(via_layer_hook, want),
                torch.equal(tp_all_gather_tokens(shard, t), whole),
            )
    q.put((rank, out))
    dist.barrier()  # neither rank may leave while the other still talks to it (gloo aborts)
    dist.destroy_process_group()


def test_token_collectives_on_two_gloo_ranks():
    results = _spawn(_collectives_main)
    for rank in (0, 1):
        for key, (shape, dtype_kept, rs_ok, hook_ok, gather_ok) in results[rank].items():
            t = int(key.rsplit("-", 1)[1])
            assert shape == (-(-t // 2), 6), key  # T padded to a multiple of 2, half each
            assert dtype_kept and rs_ok and hook_ok and gather_ok, (rank, key)


def _model_main(rank: int, port: int, q, model_dir: str) -> None:
    import torch.distributed as dist

    from axonserve.neuron import sequence_parallel
    from axonserve.neuron.sequence_parallel import SequenceParallel

    out = {}
    for dtype in ("float32", "bfloat16"):
        runner = make_runner(
            model_dir,
            rank=rank,
            dist_init=f"tcp://127.0.0.1:{port}",
            num_workers=2,
            threads=1,
            dtype=dtype,
            sequence_parallel=True,
            sequence_parallel_threshold=8,
        )
        sp = runner_logits(runner, IDS, CHUNKS)
        ran = sequence_parallel.take_forwards()
        SequenceParallel.threshold = 0  # the same runner, plain tensor parallelism
        plain = runner_logits(runner, IDS, CHUNKS)
        out[dtype] = (ran, sequence_parallel.take_forwards(), torch.equal(sp, plain), sp.float())
    q.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(600)
def test_sequence_parallel_forward_equals_tensor_parallel(tmp_path):
    model_dir = make_tiny_llama(str(tmp_path / "tiny"))
    results = _spawn(_model_main, model_dir)
    with torch.inference_mode():
        want = hf_model(model_dir)(torch.tensor([IDS])).logits[0]
    for rank in (0, 1):
        for dtype, (ran, ran_plain, equal, logits) in results[rank].items():
            assert ran == 2 and ran_plain == 0, (rank, dtype, ran, ran_plain)  # the 13- and 9-token chunks
            assert equal, (rank, dtype)  # bit for bit: the same matmuls, row-wise norms, same reductions
            if dtype == "float32":  # (bf16: equal to its own plain-TP logits above)
                assert torch.allclose(logits, want, atol=1e-4, rtol=0), (rank, (logits - want).abs().max())
                assert torch.equal(logits.argmax(-1), want.argmax(-1)), rank


def test_sequence_parallel_settings_are_checked():
    with pytest.raises(ValueError, match="num-workers >= 2"):
        EngineConfig(model="m", sequence_parallel=True)
    with pytest.raises(ValueError, match="threshold must be >= 1"):
        EngineConfig(model="m", sequence_parallel_threshold=0)
    for bad, what in (
        (dict(bucketing=True), "bucketing"),
        (dict(enable_lora=True), "LoRA"),
        (dict(enable_expert_parallel=True), "expert parallelism"),
        (dict(role="decode"), "disaggregation"),
    ):
        # LoRA's own start-up check (lora/checks.py) may name the clash first
        with pytest.raises(ValueError, match=f"not supported with .*{what}|{what}.* not supported with sequence"):
            EngineConfig(model="m", sequence_parallel=True, num_workers=2, **bad)
    cfg = EngineConfig(model="m", sequence_parallel=True, num_workers=2, sequence_parallel_threshold=256)
    assert cfg.sequence_parallel and cfg.sequence_parallel_threshold == 256


def test_cli_sequence_parallel_flags_reach_the_config(tmp_path, monkeypatch):
    from axonserve import cli

    model_dir = make_tiny_llama(str(tmp_path / "tiny"))
    seen = {}
    monkeypatch.setattr(cli, "cmd_serve", lambda args: seen.setdefault("config", cli.engine_config(args)) and 0)
    with pytest.raises(SystemExit):
        cli.main(["serve", model_dir, "-tp", "2", "--sequence-parallel", "--sequence-parallel-threshold", "300"])
    assert seen["config"].sequence_parallel and seen["config"].sequence_parallel_threshold == 300


@pytest.mark.parametrize("arch, refused", [("Qwen3MoeForCausalLM", "MoE"), ("Qwen3ForCausalLM", None)])
def test_moe_models_are_refused_at_start_up(tmp_path, monkeypatch, arch, refused):
    """The worker's check after loading (the MoE block's own collectives expect the whole batch);
    the structural check needs no group, so the rank count is set without one."""
    import importlib.util
    import os

    from axonserve.neuron import sequence_parallel
    from axonserve.neuron.config import ModelConfig
    from axonserve.neuron.loader import load_model
    from axonserve.neuron.parallel import TPInfo

    path = os.path.join(os.path.dirname(__file__), "..", "conftest.py")
    spec = importlib.util.spec_from_file_location("tests_root_conftest", path)
    root = importlib.util.module_from_spec(spec)  # tests/conftest.py (this package has its own conftest)
    spec.loader.exec_module(root)
    model_dir = root.make_tiny_model(str(tmp_path / "m"), arch)
    model = load_model(ModelConfig.from_dir(model_dir), torch.float32, progress=False)
    monkeypatch.setattr(TPInfo, "size", 2)
    config = EngineConfig(model=model_dir, num_workers=2, sequence_parallel=True)
    try:
        if refused:
            with pytest.raises(ValueError, match=refused):
                sequence_parallel.configure(config, model)
        else:
            sequence_parallel.configure(config, model)
            assert sequence_parallel.SequenceParallel.threshold == config.sequence_parallel_threshold
    finally:
        sequence_parallel.SequenceParallel.threshold = 0
