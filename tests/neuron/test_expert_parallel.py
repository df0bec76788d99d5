"""Tensor and expert parallelism over 2 and 4 gloo ranks give the single-process greedy tokens for
Llama, Qwen2 (sharded q/k/v biases), Qwen3 (per-head q/k norms on head shards) and Qwen3-MoE,
with each expert's intermediate dim sharded (default) or with whole experts split over the ranks
and tokens exchanged by all-to-all (`enable_expert_parallel`).

One process group per world size runs every case in turn (ranks oversubscribe the cores; the
models are tiny)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from conftest import make_tiny_model

from axonserve.protocol.messages import SamplingParams

from .conftest import MiniScheduler, make_runner, runner_logits

PROMPTS = {"a": list(range(3, 16)), "b": [7], "c": list(range(100, 109)), "d": list(range(500, 540))}
N_NEW = 8
CASES = {  # name -> (architecture, config overrides, runner overrides)
    "llama": ("LlamaForCausalLM", {}, {}),
    "qwen2": ("Qwen2ForCausalLM", {}, {}),
    "qwen3": ("Qwen3ForCausalLM", {"attention_bias": True}, {}),
    "moe-tp": ("Qwen3MoeForCausalLM", {}, {}),
    "moe-ep": ("Qwen3MoeForCausalLM", {}, {"enable_expert_parallel": True}),
}
BF16_IDS = list(range(40, 75))


def _generate(model_dir: str, **runner_kw) -> tuple[list, dict]:
    runner = make_runner(model_dir, **runner_kw)
    sched = MiniScheduler(runner, chunk=6)
    params = SamplingParams(temperature=0.0, min_tokens=N_NEW, max_tokens=N_NEW)
    for i, (rid, p) in enumerate(PROMPTS.items()):
        sched.add(rid, p, N_NEW, at_step=i, params=params)
    got = sched.run()
    layers = runner.model.model.layers
    facts = {"kv_heads": runner.kv_caches[0][0].shape[2], "q_heads": layers[0].self_attn.num_heads}
    moe = [layer.mlp.experts for layer in layers if hasattr(layer.mlp, "experts")]
    if moe:
        facts["experts"] = tuple(moe[0].gate_up_proj.shape)
    return got, facts


def _rank_main(rank: int, world: int, port: int, dirs: dict[str, str], out) -> None:
    import torch.distributed as dist

    init = f"tcp://127.0.0.1:{port}"
    try:
        results = {}
        for name, (_, _, runner_kw) in CASES.items():
            results[name] = _generate(dirs[name], num_workers=world, threads=1, rank=rank, dist_init=init, **runner_kw)
        runner = make_runner(
            dirs["moe-ep"],
            num_workers=world,
            threads=1,
            rank=rank,
            dist_init=init,
            enable_expert_parallel=True,
            dtype="bfloat16",
        )
        # by value: a tensor would travel as a file descriptor this process must outlive
        results["moe-ep-bf16-logits"] = runner_logits(runner, BF16_IDS, [20, 1, 14]).float().tolist()
        out.put((rank, results))
    except BaseException as e:  # reported to the test, which fails with it
        out.put((rank, repr(e)))
        raise
    dist.barrier()  # neither rank may leave while the other still talks to it (gloo aborts)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    made: dict[tuple, str] = {}
    dirs = {}
    for name, (arch, overrides, _) in CASES.items():
        key = (arch, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = make_tiny_model(str(tmp_path_factory.mktemp(name)), arch, **overrides)
        dirs[name] = made[key]
    return dirs


@pytest.fixture(scope="module")
def single_rank(model_dirs) -> dict:
    return {name: _generate(model_dirs[name], **CASES[name][2]) for name in CASES}


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def multi_rank(request, model_dirs) -> tuple[int, dict]:
    world = request.param
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, model_dirs, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(q.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = {r: v for r, v in results.items() if isinstance(v, str)}
    assert not errors, errors
    return world, results


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_ranks_match_single_process(case, multi_rank, single_rank):
    world, results = multi_rank
    want, facts1 = single_rank[case]
    for rank in range(world):
        got, facts = results[rank][case]
        assert got == want, (case, rank)
        assert facts["q_heads"] == 4 // world
        assert facts["kv_heads"] == max(1, 2 // world)  # 2 KV heads: replicated when world > 2
        if "experts" in facts:
            e, two_i, h = facts1["experts"]
            if case == "moe-ep":  # whole experts, E / world of them per rank
                assert facts["experts"] == (e // world, two_i, h)
            else:  # every expert, intermediate dim sharded
                assert facts["experts"] == (e, two_i // world, h)


@pytest.mark.timeout(600)
def test_expert_parallel_bfloat16_logits_close(multi_rank, model_dirs):
    world, results = multi_rank
    ref = runner_logits(make_runner(model_dirs["moe-ep"], dtype="bfloat16"), BF16_IDS, [20, 1, 14]).float()
    for rank in range(world):
        torch.testing.assert_close(torch.tensor(results[rank]["moe-ep-bf16-logits"]), ref, atol=0.1, rtol=0.05)
