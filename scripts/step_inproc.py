#!/usr/bin/env python
"""The engine's per-step Python without the bus: `axonserve bench step`'s work in one process.

The real Scheduler and ModelRunner serving the null model (`AxonNullForCausalLM`, as `bench step`
does), B requests decoding together: schedule -> plan encoded and decoded (the worker's codec) ->
execute -> result encoded and decoded -> update -> the clients' Outputs encoded. What is left of
`bench step`'s µs a step beyond this is the bus, the event loops and the other processes on the
same cores (docs/benchmarks.md#fig-step-inproc). `--cold`: an 8 MiB buffer is written before each
step (L2 is 2 MiB a core: the other actors run between a worker's steps). `--profile`: cProfile
of `execute` alone, by cumulative time.

    PYTHONPATH=. python scripts/step_inproc.py --batch 32 --steps 600
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time

import numpy as np

from axonserve.bench.step import NULL_VOCAB, make_null_model
from axonserve.config import EngineConfig
from axonserve.engine.request import Request
from axonserve.engine.scheduler import Scheduler, SchedulerConfig
from axonserve.neuron.model_runner import ModelRunner
from axonserve.neuron.model_source import resolve_model
from axonserve.protocol.codec import Codec
from axonserve.protocol.messages import Outputs, SamplingParams, StepPlan, StepResult

PARTS = ("schedule", "plan codec", "execute", "result codec", "update", "outputs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--cold", action="store_true", help="write 8 MiB before each step")
    ap.add_argument("--profile", action="store_true", help="cProfile of execute (cumulative)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="axonserve-null-") as d:
        run(a, make_null_model(d, resolve_model("SmolLM2-135M-Instruct")))


def run(a: argparse.Namespace, model: str) -> None:
    B, steps = a.batch, a.steps
    blocks = B * (4 * steps // 16 + 10)
    cfg = EngineConfig(model=model, served_model_name="null", max_num_seqs=B, num_kv_blocks=blocks, log_level="warning")
    runner = ModelRunner(cfg, 0)
    sched = Scheduler(
        SchedulerConfig.from_engine(
            cfg, max_model_len=8192, num_kv_blocks=blocks, vocab_size=NULL_VOCAB, eos_token_ids=frozenset([0])
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=3 * steps + 100, ignore_eos=True)
    for i in range(B):
        sched.add(Request(f"r{i}", [1 + i % (NULL_VOCAB - 1)] * 8, params, 8192))
    plan_codec, result_codec = Codec(StepPlan), Codec(StepResult)
    junk = np.zeros(8 << 20, dtype=np.uint8)
    parts = np.zeros(len(PARTS))

    def step() -> None:
        t = [time.perf_counter()]
        plan = sched.schedule()
        assert plan is not None
        t.append(time.perf_counter())
        p, frames = plan_codec.decode(Codec.encode(plan, sched.plan_frames))
        t.append(time.perf_counter())
        res = runner.execute(p, frames)
        t.append(time.perf_counter())
        r, _ = result_codec.decode(Codec.encode(res, runner.result_tensors))
        t.append(time.perf_counter())
        deltas = sched.update(r)
        t.append(time.perf_counter())
        Codec.encode(Outputs(deltas, 0.0))
        t.append(time.perf_counter())
        parts[:] += np.diff(t)

    for _ in range(20):  # the first prefill, then warm
        step()
    parts[:] = 0
    times = []
    for _ in range(steps):
        if a.cold:
            junk += 1
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    us = [x * 1e6 for x in times]
    print(
        f"batch {B}, {steps} steps{' (cold)' if a.cold else ''}: {statistics.median(us):.0f} µs a step "
        f"(p10 {np.percentile(us, 10):.0f}, p90 {np.percentile(us, 90):.0f}); mean by part: "
        + ", ".join(f"{n} {v / steps * 1e6:.0f}" for n, v in zip(PARTS, parts))
    )
    if a.profile:
        prof, execute = cProfile.Profile(), runner.execute

        def profiled(plan, frames):
            prof.enable()
            try:
                return execute(plan, frames)
            finally:
                prof.disable()

        runner.execute = profiled
        for _ in range(steps):
            step()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
