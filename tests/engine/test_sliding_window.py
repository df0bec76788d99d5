"""The scheduler's side of sliding-window models (engine/sliding_window.py): a running request gives
back the blocks past its window and keeps placeholders, admission counts what it will hold, the
prefix cache only ever maps hashes to blocks that still hold them, preemption loses nothing."""

from __future__ import annotations

from axonserve.engine.request import Request
from axonserve.engine.scheduler import Scheduler
from axonserve.engine.sliding_window import PLACEHOLDER, blocks_held, first_live_block
from axonserve.protocol.messages import SamplingParams

from .test_scheduler import Worker, drive, drive_async, make

W, BS = 8, 4


def long_req(rid: str, n: int, max_tokens: int, start: int = 10) -> Request:
    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, [start + i % 80 for i in range(n)], p, max_model_len=512)


def held(r: Request) -> int:
    return len(r.block_ids) - r.num_released_blocks


def check_invariants(s: Scheduler) -> None:
    """Every held block is referenced as often as requests hold it, a placeholder sits at every
    released index and nowhere a query can see, and every cached hash names a block holding it."""
    refs = [0] * s.blocks.num_blocks
    for r in s.running:
        assert r.block_ids[: r.num_released_blocks] == [PLACEHOLDER] * r.num_released_blocks
        assert r.num_released_blocks <= first_live_block(r.num_computed_tokens, W, BS) or not s.cfg.kv_window
        for bid in r.block_ids[r.num_released_blocks :]:
            refs[bid] += 1
    assert refs == s.blocks.ref_cnt
    assert all(s.blocks.block_hash[bid] == h for h, bid in s.blocks.cached.items())
    assert s.blocks.num_free == sum(1 for c in refs if c == 0)


def run_one(s: Scheduler, r: Request) -> list[tuple[int, int]]:
    """(computed tokens, blocks held) after each step of a request running alone."""
    s.add(r)
    w, trace = Worker(), []
    while (plan := s.schedule()) is not None:
        s.update(w.run(plan))
        check_invariants(s)
        if r in s.running:
            trace.append((r.num_computed_tokens, held(r)))
    return trace


def test_blocks_held_stop_growing_at_the_window():
    budget = 8
    trace = run_one(make(num_blocks=64, budget=budget, max_len=512, kv_window=W), long_req("a", 20, 100))
    assert trace[-1][0] > 100 and max(h for _, h in trace) <= blocks_held(10**6, budget, W, BS) == 5
    assert all(h <= -(-W // BS) + 1 for c, h in trace if c > 30)  # decoding: the window + the new token's block
    full = run_one(make(num_blocks=64, budget=budget, max_len=512), long_req("a", 20, 100))
    assert all(h >= -(-c // BS) for c, h in full)  # full attention: every block it spans
    assert full[-1][1] >= 30


def test_admission_counts_what_a_sliding_request_holds():
    """A 100-token prompt needs 26 blocks with full attention, at most 8 with a window of 8 and
    chunks of 16; a 10-block pool refuses the first and serves the second."""
    refused = make(num_blocks=10, budget=16, max_len=512).check(long_req("x", 100, 4))
    assert refused is not None and "KV blocks" in refused
    s = make(num_blocks=10, budget=16, max_len=512, kv_window=W)
    r = long_req("x", 100, 30)
    assert s.check(r) is None
    s.add(r)
    outs, finish, _ = drive(s, Worker())
    assert finish == {"x": "length"} and len(outs["x"]) == 30 and s.blocks.num_free == 10


def test_prefix_cache_hits_only_blocks_that_still_hold_their_tokens():
    """A's early blocks go back to the pool while it runs but keep their hash: B, same prompt, hits
    them after A finished; then filler requests take the pool over (evicting them) and C, same prompt
    again, hits only what survived, and still gets the same tokens."""
    s = make(num_blocks=24, budget=16, max_len=512, kv_window=W)
    w = Worker(lambda rid, i: 20 + i % 50)
    s.add(long_req("a", 40, 6))
    outs_a, _, _ = drive(s, w)
    s.add(long_req("b", 40, 6))
    outs_b, _, _ = drive(s, w)
    assert s.prefix_hits == 36 and outs_b["b"] == outs_a["a"]  # every full block but the last token's
    for i in range(4):  # other prompts: the pool's LRU reuses the freed blocks
        s.add(long_req(f"f{i}", 40, 4, start=50))
        drive(s, w)
        check_invariants(s)
    before = s.prefix_hits
    s.add(long_req("c", 40, 6))
    outs_c, _, _ = drive(s, w)
    assert s.prefix_hits - before < 36 and outs_c["c"] == outs_a["a"]
    check_invariants(s)


def test_preemption_with_a_window_loses_nothing():
    """Four long requests in a pool that holds two of them at their window: they are preempted,
    recomputed, and every one ends with its tokens; nothing leaks (sync and async scheduling)."""
    for driver in (drive, drive_async):
        s = make(num_blocks=12, budget=16, max_len=512, kv_window=W, max_seqs=4)
        w = Worker(lambda rid, i: 20 + i % 50)
        for k, rid in enumerate("abcd"):  # distinct prompts: a shared one is computed once, in turn
            s.add(long_req(rid, 30, 40, start=10 + k))
        outs, finish, _ = driver(s, w, max_steps=2000) if driver is drive else driver(s, w)
        assert s.num_preemptions > 0
        assert all(outs[r] == [20 + i % 50 for i in range(40)] for r in "abcd"), outs
        assert set(finish.values()) == {"length"} and s.blocks.num_free == 12
