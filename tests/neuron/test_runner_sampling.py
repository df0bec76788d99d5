"""Sampling parameters through ModelRunner.execute: alignment, seeds, logprobs."""

from __future__ import annotations

import torch

from axonserve.protocol.messages import SamplingParams

from .conftest import MiniScheduler, make_runner


def run(model_dir, reqs, chunk=5):
    sched = MiniScheduler(make_runner(model_dir), chunk=chunk)
    results = []
    orig = sched.runner.execute

    def spy(plan):
        res = orig(plan)
        results.append(res)
        return res

    sched.runner.execute = spy
    for rid, prompt, params, at in reqs:
        sched.add(rid, prompt, 8, at_step=at, params=params)
    return sched.run(), results


def test_seeded_request_is_independent_of_its_batch(tiny_llama_dir):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    alone, _ = run(tiny_llama_dir, [("s", [5, 6, 7], seeded, 0)])
    crowd, _ = run(
        tiny_llama_dir,
        [
            ("x", list(range(10, 30)), SamplingParams(temperature=1.0), 0),
            ("s", [5, 6, 7], seeded, 1),
            ("g", [9, 9], SamplingParams(temperature=0.0, repetition_penalty=1.3), 2),
        ],
    )
    assert alone["s"] == crowd["s"]


def test_logprobs_aligned_with_requests(tiny_llama_dir):
    out, results = run(
        tiny_llama_dir,
        [
            ("a", [1, 2, 3], SamplingParams(temperature=0.0, logprobs=2), 0),
            ("b", [4, 5, 6, 7, 8, 9, 10], SamplingParams(temperature=0.0), 0),
        ],
    )
    seen = 0
    for res in results:
        if not res.request_ids:
            continue
        if "a" not in res.request_ids:
            assert res.logprobs is None  # nobody in this step asked
            continue
        assert res.logprobs is not None and len(res.logprobs) == len(res.request_ids)
        for rid, tok, lp in zip(res.request_ids, res.sampled_token_ids, res.logprobs):
            if rid == "b":
                assert lp is None
            else:
                seen += 1
                assert lp.rank == 1 and lp.top_ids[0] == tok and len(lp.top_ids) == 2
                assert lp.logprob == lp.top_logprobs[0] <= 0.0
    assert seen == 8 and len(out["a"]) == 8


def test_step_results_in_plan_order_and_forward_time(tiny_llama_dir):
    _, results = run(
        tiny_llama_dir,
        [("p", list(range(3, 15)), SamplingParams(temperature=0.0), 0), ("q", [7], SamplingParams(temperature=0.0), 0)],
    )
    first = results[0]
    assert first.request_ids == ["q"]  # "p" is still prefilling (12 tokens, chunk 5)
    assert all(r.forward_s > 0 for r in results)
    both = next(r for r in results if len(r.request_ids) == 2)
    assert both.request_ids == ["p", "q"]  # plan order, though the flat batch runs decodes first
    assert torch.tensor(both.sampled_token_ids).lt(1024).all()


def test_warm_up_leaves_nothing_behind(tiny_llama_dir):
    """The start-up warm-up prefill (max_num_batched_tokens tokens over the first KV blocks)
    holds no request afterwards, and a request served on those same blocks - with their stale
    K/V from the warm-up - decodes what a fresh runner decodes, greedy and seeded."""
    reqs = [
        ("g", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0), 0),
        ("s", [3, 1, 4, 1, 5], SamplingParams(temperature=1.0, seed=7), 1),
    ]
    fresh, _ = run(tiny_llama_dir, reqs)
    sched = MiniScheduler(make_runner(tiny_llama_dir, max_num_batched_tokens=256, num_kv_blocks=80), chunk=5)
    assert sched.runner.warm_up() > 0
    assert not sched.runner.requests
    for rid, prompt, params, at in reqs:
        sched.add(rid, prompt, 8, at_step=at, params=params)
    assert sched.run() == fresh


def test_seeded_requests_survive_preemption_and_a_new_runner(tiny_llama_dir):
    """Preemption re-sends a request as new (its state dropped, then rebuilt from prompt + outputs
    and recomputed); a restarted worker rebuilds it the same way in a fresh runner. A seeded request's
    tokens go on as if neither had happened: its draws hash (seed, position), not a generator's count.
    Temperature only (the native kernel where built) and top-p (the torch path)."""
    seeded = {
        "a": ([5, 6, 7], SamplingParams(temperature=1.0, seed=1234)),
        "b": ([8, 3, 2, 9], SamplingParams(temperature=1.0, top_p=0.9, seed=-5)),
    }
    n = 8  # run()'s max_tokens
    alone = {rid: run(tiny_llama_dir, [(rid, p, params, 0)])[0][rid] for rid, (p, params) in seeded.items()}
    assert all(len(set(t)) > 2 for t in alone.values()), alone  # sampling, not a fixed point

    # preempted twice each, in a crowd: blocks freed, state dropped on the runner, re-sent as new
    sched = MiniScheduler(make_runner(tiny_llama_dir, seed=99), chunk=5)
    sched.add("x", list(range(10, 30)), n, params=SamplingParams(temperature=1.0))
    for rid, (p, params) in seeded.items():
        sched.add(rid, p, n, at_step=1, params=params)
    preempted: set[tuple[str, int]] = set()
    while sched.pending or sched.running:
        for r in sched.running:
            at = (r.rid, len(r.outputs))
            if r.rid in seeded and at[1] in (2, 5) and at not in preempted and r.computed == len(r.tokens) - 1:
                sched.free += r.blocks
                r.blocks, r.computed, r.started = [], 0, False
                sched.to_finish.append(r.rid)
                preempted.add(at)
        sched.step()
    assert len(preempted) == 4
    assert {rid: sched.done[rid].outputs for rid in seeded} == alone

    # a worker restart: a fresh runner (another engine seed) gets each request after 3 outputs
    for rid, (p, params) in seeded.items():
        fresh = MiniScheduler(make_runner(tiny_llama_dir, seed=7), chunk=5)
        fresh.add(rid, p + alone[rid][:3], n - 3, params=params)
        fresh.pending[0][1].prompt = list(p)  # the outputs so far are not prompt (min_tokens, penalties)
        assert fresh.run()[rid] == alone[rid][3:]
