"""Scheduler policy unit tests: budget, chunking, blocks, preemption, stop rules."""

from __future__ import annotations

import collections

import pytest

from axonserve.engine.buckets import BucketConfig, parse_buckets, pick, pow2_upto
from axonserve.engine.request import Request, Status
from axonserve.engine.scheduler import Scheduler, SchedulerConfig
from axonserve.protocol.messages import SamplingParams, StepPlan, StepResult

EOS = 2


def make(num_blocks=64, block_size=4, budget=64, max_seqs=8, max_len=128, **kw) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_len,
            block_size=block_size,
            num_kv_blocks=num_blocks,
            vocab_size=100,
            eos_token_ids=frozenset({EOS}),
            **kw,
        )
    )


def req(rid, n, prefix=(), priority=0, **params) -> Request:
    p = SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **params})
    toks = list(prefix) + list(range(10, 10 + n))
    return Request(rid, toks, p, max_model_len=128, priority=priority)


class Worker:
    """Tracks what a worker would hold, checks plan consistency, samples `next_tok(rid)`."""

    def __init__(self, next_tok=lambda rid, i: 50):
        self.state: dict[str, dict] = {}
        self.next_tok = next_tok

    def run(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_request_ids:
            self.state.pop(rid, None)
        order = []
        for nr in plan.new:
            assert nr.request_id not in self.state
            self.state[nr.request_id] = dict(
                toks=list(nr.token_ids), c=nr.num_computed_tokens, blocks=list(nr.block_ids), np=nr.num_prompt_tokens
            )
            order.append(nr.request_id)
        for cr in plan.cached:
            self.state[cr.request_id]["blocks"] += cr.new_block_ids
            order.append(cr.request_id)
        ids, toks = [], []
        if plan.multi_step:  # each decodes its n tokens one forward at a time, feeding its samples back
            counts = []
            for rid, n in zip(order, plan.num_scheduled_tokens):
                s = self.state[rid]
                assert s["c"] == len(s["toks"]) - 1, "a multi-step request must be a decode"
                assert len(s["blocks"]) * 4 >= s["c"] + n, "tokens scheduled without KV slots"
                for _ in range(n):
                    s["c"] += 1
                    s["toks"].append(self.next_tok(rid, len(s["toks"]) - s["np"]))
                ids.append(rid)
                toks += s["toks"][-n:]
                counts.append(n)
            return StepResult(plan.step_id, ids, toks, num_sampled=counts)
        for rid, n in zip(order, plan.num_scheduled_tokens):
            s = self.state[rid]
            s["c"] += n
            assert s["c"] <= len(s["toks"])
            assert len(s["blocks"]) * 4 >= s["c"], "tokens scheduled without KV slots"
            if s["c"] == len(s["toks"]):
                t = self.next_tok(rid, len(s["toks"]) - s["np"])  # a function of the tokens
                s["toks"].append(t)
                ids.append(rid)
                toks.append(t)
        return StepResult(plan.step_id, ids, toks)


def drive(s: Scheduler, w: Worker, max_steps=200, depth=1):
    """Schedule and run until done; depth 2 is the actor's async loop (a plan is made before the
    last one's result is back)."""
    outs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    plans, inflight, ahead = [], collections.deque(), 0
    for _ in range(max_steps):
        while len(inflight) < depth and (plan := s.schedule()) is not None:
            ahead += bool(inflight) and bool(plan.cached)
            plans.append(plan)
            inflight.append(plan)
        if not inflight:
            break
        for d in s.update(w.run(inflight.popleft())):
            outs.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finish_reason:
                finish[d.request_id] = d.finish_reason
    assert depth == 1 or ahead > 0, "no plan was made ahead of a result"
    return outs, finish, plans


def drive_async(s: Scheduler, w: Worker):
    return drive(s, w, max_steps=300, depth=2)


def test_continuous_batching_joins_next_step():
    s, w = make(), Worker()
    s.add(req("a", 5))
    p1 = s.schedule()
    assert [n.request_id for n in p1.new] == ["a"] and p1.num_scheduled_tokens == [5]
    s.update(w.run(p1))
    s.add(req("b", 3))
    p2 = s.schedule()
    assert [n.request_id for n in p2.new] == ["b"] and [c.request_id for c in p2.cached] == ["a"]
    assert p2.num_scheduled_tokens == [3, 1]  # b's prefill and a's decode share the step


def test_chunked_prefill_under_budget_and_decode_first():
    s, w = make(budget=4), Worker()
    s.add(req("a", 3, max_tokens=20))
    s.update(w.run(s.schedule()))
    s.add(req("long", 10))
    sizes = []
    for _ in range(4):
        p = s.schedule()
        sizes.append(p.num_scheduled_tokens)
        s.update(w.run(p))
    # a decodes every step (1 token), long prefills in 3-token chunks behind it
    assert sizes == [[3, 1], [1, 3], [1, 3], [1, 1]]


def test_stop_conditions():
    toks = {"eos": [5, EOS, 7], "stopid": [5, 9, 7], "len": [5] * 10, "ign": [EOS] * 10, "min": [EOS, EOS, 6, EOS]}
    s, w = make(), Worker(lambda rid, i: toks[rid][i])
    s.add(req("eos", 3))
    s.add(req("stopid", 3, stop_token_ids=[9]))
    s.add(req("len", 3, max_tokens=4))
    s.add(req("ign", 3, max_tokens=3, ignore_eos=True))
    s.add(req("min", 3, min_tokens=3))
    outs, finish, _ = drive(s, w)
    assert outs["eos"] == [5, EOS] and finish["eos"] == "stop"
    assert outs["stopid"] == [5, 9] and finish["stopid"] == "stop"
    assert outs["len"] == [5] * 4 and finish["len"] == "length"
    assert outs["ign"] == [EOS] * 3 and finish["ign"] == "length"
    assert outs["min"] == [EOS, EOS, 6, EOS] and finish["min"] == "stop"
    assert s.blocks.num_free == s.blocks.num_blocks and not s.requests


def test_abort_frees_and_tells_worker():
    s, w = make(), Worker()
    s.add(req("a", 6))
    s.update(w.run(s.schedule()))
    used = s.blocks.num_free
    assert [r.request_id for r in s.abort(["a", "a", "zzz"])] == ["a"]
    assert s.blocks.num_free == s.blocks.num_blocks > used
    p = s.schedule()
    assert p.finished_request_ids == ["a"] and not p.new and not p.cached


def _tight_pool(**kw) -> tuple[Scheduler, Worker]:
    """6 blocks of 4 slots; three requests of 6 prompt + 8 output tokens cannot all fit."""
    s, w = make(num_blocks=6, **kw), Worker(lambda rid, i: 20 + i)
    for rid in "abc":
        s.add(req(rid, 6, max_tokens=8))
    return s, w


def test_preemption_recomputes_and_loses_nothing():
    s, w = _tight_pool()
    outs, finish, plans = drive(s, w)
    assert s.num_preemptions > 0
    assert all(outs[r] == list(range(20, 28)) for r in "ab"), outs
    assert all(finish[r] == "length" for r in "abc")
    resumed = [n for p in plans for n in p.new if n.num_prompt_tokens < len(n.token_ids)]
    assert resumed, "a preempted request is resent with its generated tokens"
    assert s.blocks.num_free == 6


def test_rejects_what_can_never_run():
    s = make(num_blocks=2, max_len=16)
    assert "maximum context length is 16" in s.check(req("x", 16))
    assert "KV blocks" in s.check(req("y", 12))
    assert s.check(req("ok", 5)) is None
    bad = Request("v", [5, 100], SamplingParams(), max_model_len=16)
    assert "vocabulary" in s.check(bad)


def test_max_num_seqs_caps_running():
    s, _w = make(max_seqs=2), Worker()
    for rid in "abc":
        s.add(req(rid, 2))
    p = s.schedule()
    assert len(p.new) == 2 and len(s.waiting) == 1
    assert all(r.status == Status.RUNNING for r in s.running)


def test_prefix_cache_reuses_full_blocks_and_recomputes_last_token():
    s, w = make(block_size=4), Worker()
    shared = list(range(60, 72))  # 3 full blocks
    s.add(req("a", 2, prefix=shared))  # 14 tokens
    drive(s, w)
    s.add(req("b", 3, prefix=shared))  # same 3 leading blocks
    p = s.schedule()
    (nb,) = p.new
    assert nb.num_computed_tokens == 12 and p.num_scheduled_tokens == [3]
    s.update(w.run(p))
    assert s.prefix_hits == 12
    # whole prompt cached: the last token is still recomputed for its logits
    s.add(req("c", 0, prefix=shared))
    p = s.schedule()
    assert p.new[-1].num_computed_tokens == 8 and p.num_scheduled_tokens[len(p.new) - 1] == 4


@pytest.mark.parametrize("depth", [1, 2])
def test_a_burst_sharing_a_prefix_computes_it_once(depth):
    """Prompts arriving together with a shared prefix: the first of each group computes it and
    the others reuse it in the same plan (the forward writes every row's K/V before any row
    attends); outputs are those of a run without prefix caching, with and without async
    scheduling (depth 2)."""
    shared = [list(range(60, 72)), list(range(72, 84))]  # two groups, 3 full blocks each

    def burst(s):
        for i in range(4):
            s.add(req(f"r{i}", 2 + i, prefix=shared[i % 2]))
        s.add(req("solo", 5, prefix=[90, 91, 92, 93]))

    s, w = make(block_size=4, budget=64), Worker(next_tok=lambda rid, i: 40 + i)
    burst(s)
    outs, finish, plans = drive(s, w, depth=depth)
    assert [nr.request_id for nr in plans[0].new] == ["r0", "r1", "r2", "r3", "solo"]
    hits = {nr.request_id: nr.num_computed_tokens for nr in plans[0].new}
    assert hits == {"r0": 0, "r1": 0, "solo": 0, "r2": 12, "r3": 12}
    assert plans[0].num_scheduled_tokens == [14, 15, 4, 5, 9]
    assert s.prefix_hits == 24
    ref_s, ref_w = make(block_size=4, budget=64, enable_prefix_caching=False), Worker(next_tok=lambda rid, i: 40 + i)
    burst(ref_s)
    assert (outs, finish) == drive(ref_s, ref_w, depth=depth)[:2]


def test_a_request_reusing_a_prefix_from_the_same_plan_keeps_its_place():
    """With two seats, the second prompt of a shared prefix takes the second seat in the plan that
    computes the prefix (first come, first served), and the unrelated prompt waits for a seat."""
    shared = list(range(60, 72))
    s, w = make(block_size=4, budget=64, max_seqs=2), Worker(next_tok=lambda rid, i: 40 + i)
    s.add(req("a", 2, prefix=shared, max_tokens=3))
    s.add(req("b", 3, prefix=shared, max_tokens=3))
    s.add(req("solo", 5, prefix=[90, 91, 92, 93], max_tokens=3))
    outs, finish, plans = drive(s, w)
    admitted = [nr.request_id for p in plans for nr in p.new]
    assert admitted == ["a", "b", "solo"] and [nr.request_id for nr in plans[0].new] == ["a", "b"]
    assert plans[0].new[1].num_computed_tokens == 12
    assert set(finish) == {"a", "b", "solo"}


def test_a_prefix_computed_in_chunks_is_followed_block_by_block():
    """A shared prefix longer than the step's budget: the follower takes each block as soon as it
    is published and never waits on a block nobody computes."""
    s, w = make(block_size=4, budget=8), Worker(next_tok=lambda rid, i: 40 + i)
    shared = list(range(60, 80))  # 5 full blocks
    s.add(req("a", 2, prefix=shared))
    s.add(req("b", 3, prefix=shared))
    outs, finish, plans = drive(s, w)
    (b_new,) = [nr for p in plans for nr in p.new if nr.request_id == "b"]
    assert b_new.num_computed_tokens == 20 and finish == {"a": "length", "b": "length"}
    assert len(outs["a"]) == len(outs["b"]) == 8


def test_prefix_cache_off_and_eviction_under_pressure():
    s, w = make(block_size=4, enable_prefix_caching=False), Worker()
    s.add(req("a", 8))
    drive(s, w)
    s.add(req("b", 8))
    assert s.schedule().new[0].num_computed_tokens == 0
    # on: a freed cached block is reused (evicted) when the pool runs short
    s, w = make(num_blocks=4, block_size=4), Worker()
    s.add(req("a", 8, max_tokens=1))
    drive(s, w)
    s.add(req("b", 12, prefix=[99] * 3, max_tokens=1))  # needs all 4 blocks
    outs, finish, _ = drive(s, w)
    assert finish["b"] == "length"
    s.add(req("a2", 8, max_tokens=1))
    assert s.schedule().new[0].num_computed_tokens == 0  # a's blocks were evicted


def test_priority_policy_orders_waiting_and_picks_victim():
    s, _w = make(max_seqs=1, policy="priority"), Worker()
    s.add(req("low", 2, priority=5))
    s.add(req("high", 2, priority=-1))
    assert [n.request_id for n in s.schedule().new] == ["high"]
    s2 = make(num_blocks=5, policy="priority")
    s2.add(req("low", 6, priority=5, max_tokens=8))
    s2.add(req("high", 6, priority=0, max_tokens=8))
    outs, finish, _ = drive(s2, Worker(lambda rid, i: 20 + i))
    assert outs["low"] == outs["high"] == list(range(20, 28))


def test_chunked_prefill_off_waits_for_room():
    s, _w = make(budget=8, enable_chunked_prefill=False), Worker()
    assert "chunked prefill disabled" in s.check(req("huge", 9))
    s.add(req("a", 6))
    s.add(req("b", 6, prefix=[99]))  # (nothing shared with a: all 7 tokens to compute)
    p = s.schedule()
    assert p.num_scheduled_tokens == [6]  # b does not fit the rest of the budget: no split


# --------------------------------------------------------------------------- bucketing mode


def buckets(**kw) -> BucketConfig:
    base = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=4)
    return BucketConfig.resolve(**(base | kw))


def test_bucket_selection_and_defaults():
    assert pow2_upto(6) == [1, 2, 4, 6] and pow2_upto(8) == [1, 2, 4, 8] and pow2_upto(1) == [1]
    assert pow2_upto(100, 16) == [16, 32, 64, 100] and pow2_upto(8, 16) == [8]
    assert [pick([1, 2, 4, 6], n) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]
    with pytest.raises(ValueError, match="largest bucket"):
        pick([1, 2], 3)
    b = BucketConfig.resolve(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=8192, block_size=16)
    assert b.decode_batch == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert b.context_batch == (1, 2, 4, 8)
    assert b.context_len == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert b.decode_len == (128, 256, 512, 1024, 2048, 4096, 8192)
    # caps that are not powers of two are included; KV lengths round up to whole blocks
    b = BucketConfig.resolve(max_num_seqs=3, max_num_batched_tokens=100, max_model_len=50, block_size=16)
    assert b.decode_batch == (1, 2, 3) and b.context_len == (16, 32, 50) and b.decode_len == (64,)
    b = buckets(decode_len=[10, 40, 40], context_batch=[4, 1])  # explicit: sorted, deduped, rounded
    assert b.decode_len == (12, 40) and b.context_batch == (1, 4)
    assert b.decode_shape(3, 13) == ("decode", 4, 1, 40)
    # the KV bucket holds at least the query bucket (16 > 12: the next KV bucket, 40)
    assert b.prefill_shape(2, 9, 12) == ("prefill", 4, 16, 40)
    assert b.contains(("decode", 4, 1, 40)) and not b.contains(("decode", 3, 1, 40))
    assert not b.contains(("prefill", 4, 16, 13))
    assert parse_buckets("1, 2,8") == [1, 2, 8] and parse_buckets("") == []
    with pytest.raises(ValueError):
        parse_buckets("1,x")


def test_cli_bucket_flags():
    import argparse

    from axonserve.cli import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    a = p.parse_args(["m", "--bucketing", "--context-len-buckets", "16,64", "--decode-batch-buckets", "1,4"])
    assert a.bucketing and a.context_len_buckets == [16, 64] and a.decode_batch_buckets == [1, 4]
    assert a.context_batch_buckets == [] and not p.parse_args(["m"]).bucketing


def drive_bucketed(s: Scheduler, w: Worker, max_steps=400):
    """drive(), checking every plan fits the bucket limits and never mixes phases."""
    b = s.cfg.buckets
    outs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    phases = []
    for _ in range(max_steps):
        ready = {r.request_id for r in s.running if r.num_tokens - r.num_computed_tokens == 1}
        plan = s.schedule()
        if plan is None:
            break
        ns = plan.num_scheduled_tokens
        ids = [n.request_id for n in plan.new] + [c.request_id for c in plan.cached]
        if ns:
            phases.append(s._last_phase)
            assert sum(ns) <= s.cfg.max_num_batched_tokens
            if s._last_phase == "decode":
                assert not plan.new and set(ns) == {1} and set(ids) <= ready
                assert len(ns) <= b.max_decode_batch
            else:
                assert not set(ids) & ready, "a decode rode along in a prefill step"
                assert len(ns) <= b.max_context_batch and max(ns) <= b.max_context_len
        for d in s.update(w.run(plan)):
            outs.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finish_reason:
                finish[d.request_id] = d.finish_reason
    return outs, finish, phases


def make_b(bkw=None, **kw) -> Scheduler:
    budget, seqs = kw.get("budget", 64), kw.get("max_seqs", 8)
    b = buckets(max_num_seqs=seqs, max_num_batched_tokens=budget, **(bkw or {}))
    return make(buckets=b, **kw)


def test_bucketing_steps_are_pure_and_fit_buckets():
    s = make_b(dict(context_batch=[1, 2], context_len=[4, 8], decode_batch=[1, 2, 4]), budget=12)
    w = Worker(lambda rid, i: 20 + i)
    for i, n in enumerate((3, 17, 1, 9, 5, 2, 11)):
        s.add(req(f"r{i}", n, max_tokens=6))
    outs, _, phases = drive_bucketed(s, w)
    assert all(outs[f"r{i}"] == list(range(20, 26)) for i in range(7)), outs
    assert set(phases) == {"decode", "prefill"}
    assert s.blocks.num_free == s.blocks.num_blocks and not s.requests


def test_bucketing_alternates_so_neither_phase_starves():
    s, w = make_b(dict(context_len=[4]), budget=64), Worker()
    s.add(req("a", 3, max_tokens=30))
    s.update(w.run(s.schedule()))  # a prefilled: now decoding
    s.add(req("long", 20, max_tokens=2))  # 5 chunks of 4
    sizes = []
    for _ in range(11):
        p = s.schedule()
        sizes.append((s._last_phase, p.num_scheduled_tokens))
        s.update(w.run(p))
    # the last step was a prefill, so a decode goes first; then strict alternation until the
    # 5th chunk completes the prompt, after which both decode together
    assert sizes == [("decode", [1]), ("prefill", [4])] * 5 + [("decode", [1, 1])]


def test_bucketing_decode_round_robin_and_preemption():
    # decode bucket holds 2 of 3 ready requests: each still decodes every other step at worst
    s, w = make_b(dict(decode_batch=[1, 2])), Worker(lambda rid, i: 20 + i)
    for rid in "abc":
        s.add(req(rid, 2, max_tokens=8))
    outs, _, _ = drive_bucketed(s, w)
    assert all(outs[r] == list(range(20, 28)) for r in "abc")
    # tiny pool: preemption under bucketing loses nothing
    s, w = make_b(dict(context_len=[4, 8]), num_blocks=6), Worker(lambda rid, i: 20 + i)
    for rid in "abc":
        s.add(req(rid, 6, max_tokens=8))
    outs, _, _ = drive_bucketed(s, w)
    assert s.num_preemptions > 0
    assert all(outs[r] == list(range(20, 28)) for r in "ab"), outs
    assert s.blocks.num_free == 6


def test_bucketing_chunk_off_rejects_prompts_beyond_the_largest_context_bucket():
    s = make_b(dict(context_len=[4, 8]), budget=64, enable_chunked_prefill=False)
    assert "context-length bucket" in s.check(req("x", 9))
    assert s.check(req("ok", 8)) is None


def test_bucketing_chunk_off_resumes_a_preempted_request_longer_than_any_bucket():
    # 8 blocks of 4: two 6-token prompts growing to 18 tokens collide at ~16 tokens each, so
    # the victim comes back with more tokens than the largest context bucket (8)
    s = make_b(dict(context_len=[4, 8]), num_blocks=8, enable_chunked_prefill=False, enable_prefix_caching=False)
    w = Worker(lambda rid, i: 20 + i)
    for rid in "ab":
        s.add(req(rid, 6, max_tokens=12))
    outs, _, _ = drive_bucketed(s, w)
    assert s.num_preemptions > 0
    assert all(outs[r] == list(range(20, 32)) for r in "ab"), outs


def test_chunking_off_still_resumes_a_request_grown_past_the_budget():
    """Preempted after growing beyond max_num_batched_tokens: recomputed in chunks, not stuck."""
    s, w = (
        make(num_blocks=5, budget=8, enable_chunked_prefill=False, enable_prefix_caching=False),
        Worker(lambda rid, i: 20 + i),
    )
    for rid in "ab":
        s.add(req(rid, 7, max_tokens=10))
    outs, finish, plans = drive(s, w)
    assert any(n.num_computed_tokens == 0 and len(n.token_ids) > 8 for p in plans for n in p.new)
    assert all(outs.get(r) == list(range(20, 30)) and finish.get(r) == "length" for r in "ab"), outs


# ---------------------------------------------------------------- speculative decoding


def test_spec_drafts_roll_back_across_a_block_boundary():
    """Drafts crossing into a new block, one accepted: the computed count moves back over the
    rejected positions, only blocks of verified tokens reach the prefix cache, and the next
    token is computed in the first rejected slot (the vllm-neuron slot-accounting defect)."""
    from axonserve.config import SpeculativeConfig

    s = make(block_size=4, speculative=SpeculativeConfig(method="ngram", disable_by_batch_size=0, max_verify_rows=0))
    r = req("a", 6)  # prompt 10..15
    s.add(r)
    plan = s.schedule()
    assert plan.num_scheduled_tokens == [6] and not plan.draft_token_ids
    s.update(StepResult(plan.step_id, ["a"], [40]))  # 7 known, 6 computed
    r.spec_token_ids = [41, 42, 43]  # positions 7, 8, 9: into block 2
    plan = s.schedule()
    assert plan.num_scheduled_tokens == [4] and plan.draft_token_ids == {"a": [41, 42, 43]}
    assert len(r.block_ids) == 3 and plan.cached[0].new_block_ids == r.block_ids[2:]
    deltas = s.update(StepResult(plan.step_id, ["a"], [41, 50], num_sampled=[2]))  # 41 accepted, 42 rejected
    assert deltas[0].new_token_ids == [41, 50]
    assert r.token_ids[6:] == [40, 41, 50] and r.num_computed_tokens == 8
    assert r.num_cached_blocks == 2  # positions 0..7 verified; block 2 held rejected drafts
    assert s.spec.counters() == (1, 3, 1, [1, 0, 0])
    plan = s.schedule()  # token 50 at position 8: block 2's first slot, no new block
    assert plan.num_scheduled_tokens == [1] and plan.cached[0].new_block_ids == [] and not plan.draft_token_ids


def test_spec_accepted_tokens_stop_at_eos_and_drafts_stop_at_max_tokens():
    from axonserve.config import SpeculativeConfig

    s = make(block_size=4, speculative=SpeculativeConfig(method="ngram", disable_by_batch_size=0, max_verify_rows=0))
    r = req("a", 4, max_tokens=5)
    s.add(r)
    plan = s.schedule()
    s.update(StepResult(plan.step_id, ["a"], [40]))
    assert s.spec.candidates(s.running) == [(r, 3)]
    r.spec_token_ids = [41, EOS, 43]
    plan = s.schedule()
    deltas = s.update(StepResult(plan.step_id, ["a"], [41, EOS, 43, 44], num_sampled=[4]))
    assert deltas[0].new_token_ids == [41, EOS] and deltas[0].finish_reason == "stop"
    r2 = req("b", 4, max_tokens=3)
    s.add(r2)
    plan = s.schedule()
    s.update(StepResult(plan.step_id, ["b"], [40]))
    assert s.spec.candidates(s.running) == [(r2, 1)]  # 1 output, 2 to go: one draft + the bonus


def test_draft_trees_travel_with_their_parents_and_count_by_depth():
    """EAGLE-2 drafts from the worker: the plan carries each tree's parents (cut with its drafts,
    still a tree), a malformed tree is dropped, and the back-off rate is accepted / path length."""
    from axonserve.config import SpeculativeConfig

    s = make(
        block_size=4,
        speculative=SpeculativeConfig(
            method="eagle",
            num_speculative_tokens=6,
            tree_width=3,
            tree_depth=3,
            disable_by_batch_size=0,
            max_verify_rows=0,
        ),
    )
    r = req("a", 6, max_tokens=5)
    s.add(r)
    plan = s.schedule()
    assert plan.num_drafts == {"a": 4}  # never past the last token: 4 left after this step's one
    s.update(
        StepResult(
            plan.step_id,
            ["a"],
            [40],
            draft_request_ids=["a"],
            draft_token_ids=[[41, 42, 43, 44, 45]],
            draft_parents=[[-1, -1, 0, 1, 2]],
        )
    )
    assert r.spec_token_ids == [41, 42, 43] and r.spec_parents == [-1, -1, 0]  # room for 3 more after 40
    plan = s.schedule()
    assert plan.draft_token_ids == {"a": [41, 42, 43]} and plan.draft_parents == {"a": [-1, -1, 0]}
    assert plan.num_scheduled_tokens == [4]
    s.update(
        StepResult(
            plan.step_id,
            ["a"],
            [41, 43, 50],
            num_sampled=[3],  # path 41 -> 43, then 50
            draft_request_ids=["a"],
            draft_token_ids=[[51, 52]],
            draft_parents=[[-1, 5]],
        )
    )
    assert r.num_computed_tokens == 9 and r.spec.rate == 1.0  # 2 accepted of a 2-deep tree
    assert s.spec.counters() == (1, 3, 2, [1, 1, 0, 0, 0, 0])
    assert r.spec_token_ids == [] and r.spec_parents is None  # parent 5 of draft 1: not a tree, dropped


def test_verify_rows_shrink_drafts_as_more_requests_draft():
    from axonserve.config import SpeculativeConfig
    from axonserve.speculative.scheduler import SpecDecoding

    spec = SpecDecoding(SpeculativeConfig(method="eagle", num_speculative_tokens=8, max_verify_rows=24))
    reqs = [req(str(i), 4, max_tokens=64) for i in range(13)]
    assert [k for _, k in spec.pick(reqs[:1])] == [8]  # 24 rows: all 8 drafts and the root
    assert [k for _, k in spec.pick(reqs[:4])] == [5] * 4
    assert [k for _, k in spec.pick(reqs[:8])] == [2] * 8
    assert [k for _, k in spec.pick(reqs[:12])] == [1] * 12
    assert spec.pick(reqs) == []  # 13 requests: no room for a draft each


def test_ngram_propose_takes_the_longest_most_recent_match():
    from axonserve.speculative.scheduler import ngram_propose

    assert ngram_propose([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 2, 1, 3) == [8, 5]  # latest "1 2 3"
    assert ngram_propose([4, 7, 1, 2, 5, 2], 3, 1, 3) == [5, 2]  # only "2" matches; continuation ends
    assert ngram_propose([1, 2, 3], 3, 1, 3) == []


def test_a_request_finishing_on_its_first_token_still_publishes_its_prompt_blocks():
    s = make(block_size=4)
    a = req("a", 9, max_tokens=1)
    s.add(a)
    plan = s.schedule()
    deltas = s.update(StepResult(plan.step_id, ["a"], [40]))
    assert deltas[0].finish_reason == "length"
    b = req("b", 9)
    s.add(b)
    s.schedule()
    assert b.num_cached_tokens == 8  # both full prompt blocks came from the cache


def test_token_id_parameters_past_the_vocabulary_are_refused_at_intake():
    s = make()
    for bad in (
        dict(stop_token_ids=[100], min_tokens=1),
        dict(logit_bias={100: 1.0}),
        dict(allowed_token_ids=[5, 100]),
    ):
        why = s.check(req("x", 3, **bad))
        assert why is not None and "[0, 100)" in why, bad


def _counting(fn):
    """A token function that also counts the rows each request sampled (wasted ones included)."""
    rows = collections.Counter()

    def f(rid, i):
        rows[rid] += 1
        return fn(rid, i)

    return f, rows


def test_async_scheduling_same_outputs_stop_rules_and_one_wasted_row_at_most():
    toks = {
        "eos": [5, EOS, 7, 7],
        "stopid": [5, 9, 7, 7],
        "len": [5] * 10,
        "ign": [EOS] * 10,
        "min": [EOS, EOS, 6, EOS, 7],
    }
    got = {}
    for mode in ("sync", "async"):
        fn, rows = _counting(lambda rid, i: toks[rid][i])
        s, w = make(async_scheduling=mode == "async"), Worker(fn)
        s.add(req("eos", 3))
        s.add(req("stopid", 3, stop_token_ids=[9]))
        s.add(req("len", 3, max_tokens=4))
        s.add(req("ign", 3, max_tokens=3, ignore_eos=True))
        s.add(req("min", 3, min_tokens=3))
        outs, finish, _ = (drive_async if mode == "async" else drive)(s, w)
        got[mode] = (outs, finish)
        assert s.blocks.num_free == s.blocks.num_blocks and not s.requests
        assert all(r.num_pending == 0 for r in s.running + s.waiting)
        if mode == "async":  # a length stop is known ahead; an EOS / stop token costs one row after it
            assert rows["len"] == 4 and rows["ign"] == 3, rows
            assert rows["eos"] == 3 and rows["stopid"] == 3 and rows["min"] == 5, rows
    assert got["async"] == got["sync"]
    assert got["sync"][0]["eos"] == [5, EOS] and got["sync"][1]["len"] == "length"


def test_async_scheduling_preemption_keeps_the_token_in_flight(monkeypatch):
    """A request preempted by the plan made while its step runs still gets that step's token and
    resumes with it; nothing is lost or repeated (as in sync mode)."""
    landed_preempted = []
    append = Request.append_tokens

    def watch(self, toks, eos):
        if self.status == Status.PREEMPTED:
            landed_preempted.append(self.request_id)
        return append(self, toks, eos)

    monkeypatch.setattr(Request, "append_tokens", watch)
    s, w = _tight_pool(async_scheduling=True)
    outs, finish, plans = drive_async(s, w)
    assert s.num_preemptions > 0
    assert all(outs[r] == list(range(20, 28)) for r in "abc"), outs
    assert all(finish[r] == "length" for r in "abc")
    assert landed_preempted, "no token landed for a request preempted while its step ran"
    assert s.blocks.num_free == 6 and not s.requests


def test_multi_step_same_outputs_and_stop_rules_at_most_n_minus_1_wasted_rows():
    """num_scheduler_steps=4: a pure-decode batch runs up to 4 forwards per plan; outputs and
    finish reasons equal single-step decoding, a length stop is never overrun, and an EOS or a
    stop token costs at most 3 discarded rows."""
    toks = {
        "eos": [5, 6, 6, EOS, 7, 7, 7, 7],
        "stopid": [5, 9, 7, 7, 7, 7],
        "len": [5] * 10,
        "ign": [EOS] * 10,
        "min": [EOS, EOS, 6, EOS, 7, 7, 7, 7],
        "long": list(range(30, 50)),
    }
    got = {}
    for steps in (1, 4):
        fn, rows = _counting(lambda rid, i: toks[rid][i])
        s, w = make(num_scheduler_steps=steps), Worker(fn)
        s.add(req("eos", 3))
        s.add(req("stopid", 3, stop_token_ids=[9]))
        s.add(req("len", 3, max_tokens=5))
        s.add(req("ign", 3, max_tokens=3, ignore_eos=True))
        s.add(req("min", 3, min_tokens=3))
        s.add(req("long", 3, max_tokens=14))
        outs, finish, plans = drive(s, w)
        got[steps] = (outs, finish)
        assert s.blocks.num_free == s.blocks.num_blocks and not s.requests
        multi = [p for p in plans if p.multi_step]
        if steps == 1:
            assert not multi and s.num_forwards == len([p for p in plans if p.num_scheduled_tokens])
            continue
        assert multi and all(max(p.num_scheduled_tokens) <= 4 for p in multi)
        assert s.num_forwards == sum(
            max(p.num_scheduled_tokens) if p.multi_step else 1 for p in plans if p.num_scheduled_tokens
        )
        assert rows["len"] == 5 and rows["ign"] == 3 and rows["long"] == 14, rows  # length: never past
        assert rows["eos"] - 4 <= 3 and rows["stopid"] - 2 <= 3 and rows["min"] - 4 <= 3, rows
    assert got[4] == got[1]
    assert got[1][0]["eos"] == [5, 6, 6, EOS] and got[1][1]["stopid"] == "stop"


def test_multi_step_only_when_every_request_decodes_and_none_waits_for_a_seat():
    s, w = make(num_scheduler_steps=4, max_seqs=2), Worker()
    s.add(req("a", 3, max_tokens=20))
    p = s.schedule()  # a's prefill
    assert not p.multi_step
    s.update(w.run(p))
    p = s.schedule()  # a alone, decoding: 4 tokens in one plan
    assert p.multi_step and p.num_scheduled_tokens == [4]
    s.update(w.run(p))
    s.add(req("b", 5, max_tokens=20))
    p = s.schedule()  # b's prefill rides with a's single decode
    assert not p.multi_step and p.num_scheduled_tokens == [5, 1]
    s.update(w.run(p))
    s.add(req("c", 5, max_tokens=20))  # waits: max_num_seqs=2 are running, so it cannot take a seat
    p = s.schedule()
    assert p.multi_step and p.num_scheduled_tokens == [4, 4]
    s.update(w.run(p))
    s.abort(["a", "b"])
    s.add(req("lp", 3, max_tokens=20, logprobs=2))  # per-token logprobs: one token per plan
    for _ in range(4):
        p = s.schedule()
        assert not p.multi_step
        s.update(w.run(p))


def test_multi_step_preemption_loses_nothing():
    """The blocks a multi-step plan writes are taken before it runs; when they run out,
    requests are preempted and recomputed as in single-step decoding."""
    s, w = _tight_pool(num_scheduler_steps=4)
    outs, finish, plans = drive(s, w)
    assert s.num_preemptions > 0 and any(p.multi_step for p in plans)
    assert all(outs[r] == list(range(20, 28)) for r in "abc"), outs
    assert all(finish[r] == "length" for r in "abc")
    assert s.blocks.num_free == 6


def test_multi_step_config_is_checked():
    from axonserve.config import EngineConfig, SpeculativeConfig

    with pytest.raises(ValueError, match="num_scheduler_steps must be >= 1"):
        EngineConfig(model="m", num_scheduler_steps=0)
    with pytest.raises(ValueError, match="not supported with bucketing"):
        EngineConfig(model="m", num_scheduler_steps=4, bucketing=True)
    EngineConfig(model="m", num_scheduler_steps=4, speculative=SpeculativeConfig(method="ngram"))


def test_multi_step_only_while_speculation_is_off():
    """With drafts on offer, up to disable_by_batch_size decoding requests verify drafts one plan a
    forward; one more and the plans turn multi-step (and nothing drafts)."""
    from axonserve.config import SpeculativeConfig

    s = make(num_scheduler_steps=4, speculative=SpeculativeConfig(method="ngram", disable_by_batch_size=2))
    for rid in "ab":
        s.add(req(rid, 3, max_tokens=12))
    plan = s.schedule()  # both prefills
    s.update(StepResult(plan.step_id, ["a", "b"], [50, 50]))
    for r in s.running:
        r.spec_token_ids = [50, 50]
    plan = s.schedule()
    assert not plan.multi_step and plan.draft_token_ids == {"a": [50, 50], "b": [50, 50]}
    s.update(StepResult(plan.step_id, ["a", "b"], [50, 51, 50, 51], num_sampled=[2, 2]))  # one draft each
    s.add(req("c", 3, max_tokens=12))
    plan = s.schedule()  # c's prefill, a and b decode alongside
    assert not plan.multi_step and plan.num_scheduled_tokens == [3, 1, 1]  # new requests first
    s.update(StepResult(plan.step_id, ["a", "b", "c"], [52, 52, 50]))
    for r in s.running:
        r.spec_token_ids = [50, 50]
    plan = s.schedule()
    assert plan.multi_step and not plan.draft_token_ids and plan.num_forwards == 4
    assert s.spec.candidates(s.running) == []


def test_multi_step_shares_the_token_budget_with_every_running_request():
    s, w = make(num_scheduler_steps=8, budget=12, max_seqs=4), Worker()
    for rid in "abcd":
        s.add(req(rid, 2, max_tokens=30))
    s.update(w.run(s.schedule()))  # the four prefills
    p = s.schedule()
    assert p.multi_step and p.num_scheduled_tokens == [3, 3, 3, 3]  # 12 // 4 each, nobody left out


def test_multi_step_with_async_scheduling_same_outputs_and_bounded_waste():
    """Async scheduling makes the next multi-step plan while one runs: each request's n pending
    tokens count as known, so the plan after continues where the worker will be. Outputs equal
    single-step decoding; a stop mid-plan costs at most the rest of that plan and the next."""
    toks = {
        "eos": [5, 6, 6, EOS, 7, 7, 7, 7, 7, 7, 7, 7],
        "stopid": [5, 9] + [7] * 10,
        "len": [5] * 10,
        "min": [EOS, EOS, 6, EOS] + [7] * 8,
        "long": list(range(30, 50)),
    }
    got = {}
    for mode in ("sync1", "async4"):
        fn, rows = _counting(lambda rid, i: toks[rid][i])
        s = make(num_scheduler_steps=4 if mode == "async4" else 1, async_scheduling=mode == "async4")
        w = Worker(fn)
        s.add(req("eos", 3))
        s.add(req("stopid", 3, stop_token_ids=[9]))
        s.add(req("len", 3, max_tokens=5))
        s.add(req("min", 3, min_tokens=3))
        s.add(req("long", 3, max_tokens=14))
        outs, finish, plans = (drive_async if mode == "async4" else drive)(s, w)
        got[mode] = (outs, finish)
        assert s.blocks.num_free == s.blocks.num_blocks and not s.requests
        assert all(r.num_pending == 0 for r in s.running + s.waiting)
        if mode == "async4":
            assert sum(p.multi_step for p in plans) >= 2
            assert rows["len"] == 5 and rows["long"] == 14, rows  # a length stop is known ahead
            assert rows["eos"] - 4 <= 7 and rows["stopid"] - 2 <= 7 and rows["min"] - 4 <= 7, rows
    assert got["async4"] == got["sync1"]


def test_multi_step_with_async_scheduling_preemption_loses_nothing():
    s, w = _tight_pool(num_scheduler_steps=4, async_scheduling=True)
    outs, finish, plans = drive_async(s, w)
    assert s.num_preemptions > 0 and any(p.multi_step for p in plans)
    assert all(outs[r] == list(range(20, 28)) for r in "abc"), outs
    assert all(finish[r] == "length" for r in "abc")
    assert s.blocks.num_free == 6 and not s.requests


def test_eagle_speculation_stops_above_disable_by_batch_size():
    """Default 8: while more requests decode, plans ask worker rank 0 for no drafts (plain decoding)."""
    from axonserve.config import SpeculativeConfig

    s, w = make(max_seqs=16, speculative=SpeculativeConfig(method="eagle", num_speculative_tokens=2)), Worker()
    for i in range(9):
        s.add(req(f"r{i}", 3, max_tokens=20))
    s.update(w.run(s.schedule()))  # the prefills
    p = s.schedule()
    assert not p.want_features and not p.num_drafts  # 9 decoding
    s.update(w.run(p))
    s.abort(["r8"])
    p = s.schedule()
    assert p.want_features and sorted(p.num_drafts) == [f"r{i}" for i in range(8)]
    assert set(p.num_drafts.values()) == {2}


def test_resumed_request_outputs_are_checked_like_a_prompt():
    """AddRequest.output_token_ids (a client resuming after a scheduler restart) is hostile input too:
    ids outside the vocabulary, nothing left to generate, or more KV than the pool are refused."""
    s = make(num_blocks=8)
    bad = req("a", 4)
    bad.token_ids += [5, 100]  # 100: outside the vocabulary of 100
    assert "outside the vocabulary" in s.check(bad)
    done = req("b", 4, max_tokens=3)
    done.token_ids += [5, 6, 7]  # all 3 outputs already there
    assert "nothing left to generate" in s.check(done)
    big = req("c", 4, max_tokens=100)
    big.token_ids += [5] * 40  # 44 tokens + 1 > 8 blocks of 4
    assert "KV blocks" in s.check(big)
    ok = req("d", 4)
    ok.token_ids += [5, 6]
    assert s.check(ok) is None and ok.num_output_tokens == 2


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_restarts", -1),
        ("restart_window_s", 0),
        ("data_parallel_size", 0),
        ("distributed_executor_backend", "slurm"),
        ("ray_placement_strategy", "RANDOM"),
        ("heartbeat_timeout_s", -1),
        ("step_timeout_s", 0),
    ],
)
def test_scale_out_and_healing_settings_refuse_junk(tiny_llama_dir, field, value):
    from axonserve.config import EngineConfig

    with pytest.raises(ValueError, match=field.split("_s")[0] if field.endswith("_s") else field):
        EngineConfig(model=tiny_llama_dir, **{field: value})
