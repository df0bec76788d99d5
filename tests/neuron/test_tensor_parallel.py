"""Tensor parallelism over 2 gloo ranks gives the single-process greedy tokens."""

from __future__ import annotations

import socket

import torch.multiprocessing as mp

from axonserve.protocol.messages import SamplingParams

from .conftest import MiniScheduler, make_runner

PROMPTS = {"a": list(range(3, 16)), "b": [7], "c": list(range(100, 109))}


def _generate(model_dir: str, warm: bool = False, **runner_kw) -> tuple[dict[str, list[int]], tuple[int, ...]]:
    runner = make_runner(model_dir, **runner_kw)
    if warm:
        runner.warm_up()
    sched = MiniScheduler(runner, chunk=5)
    for i, (rid, p) in enumerate(PROMPTS.items()):
        sched.add(rid, p, 6, at_step=i, params=SamplingParams(temperature=0.0))
    return sched.run(), tuple(runner.kv_caches[0][0].shape)


def _rank_main(rank: int, model_dir: str, port: int, out) -> None:
    import torch.distributed as dist

    # pools of different sizes (ranks size theirs from their own free memory): the start-up
    # warm-up must still run one plan on both, or its collectives would not pair up
    got, kv_shape = _generate(
        model_dir,
        warm=True,
        num_workers=2,
        threads=1,
        rank=rank,
        num_kv_blocks=256 - 56 * rank,
        dist_init=f"tcp://127.0.0.1:{port}",
    )
    out.put((rank, (got, kv_shape)))
    dist.barrier()  # neither rank may leave while the other still talks to it (gloo aborts)
    dist.destroy_process_group()


def test_tp2_matches_single_rank(tiny_llama_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, tiny_llama_dir, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    want, kv_shape = _generate(tiny_llama_dir)
    assert kv_shape[2] == 2 and results[0][1][2] == results[1][1][2] == 1  # each rank holds half the KV heads
    assert results[0][0] == want and results[1][0] == want
