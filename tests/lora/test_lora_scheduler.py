"""The scheduler's LoRA rules (pure policy, no processes): at most max_loras distinct adapters
among the requests of a step (a request whose adapter would exceed that waits, later ones whose
adapter fits go ahead, as vLLM's scheduler does; with nothing running anything is admitted), the
adapter is part of the prefix-cache key, it rides NewRequestData (also after preemption), and an
adapter request is refused when LoRA is off."""

from __future__ import annotations

from engine.test_scheduler import Worker, drive, make, req

from axonserve.protocol.messages import LoraSpec

A, B, C = LoraSpec("a", 1, "/a"), LoraSpec("b", 2, "/b"), LoraSpec("c", 3, "/c")


def lreq(rid, n, lora, prefix=(), **kw):
    r = req(rid, n, prefix, **kw)
    r.lora = lora
    return r


def adapters_per_step(plans, loras: dict[str, LoraSpec | None]) -> list[set[int]]:
    """The distinct adapters among each plan's scheduled requests."""
    out = []
    for p in plans:
        ids = [n.request_id for n in p.new] + [c.request_id for c in p.cached]
        out.append({loras[i].lora_id for i in ids if loras[i] is not None})
    return out


def test_refused_without_enable_lora():
    s = make()
    assert "--enable-lora" in s.check(lreq("x", 3, A))
    assert s.check(lreq("y", 3, None)) is None
    assert make(max_loras=1).check(lreq("z", 3, A)) is None


def test_max_loras_bounds_each_step_and_everything_completes():
    s, w = make(max_loras=1), Worker()
    loras = {"a1": A, "b1": B, "a2": A, "base": None, "c1": C, "b2": B}
    for rid, lo in loras.items():
        s.add(lreq(rid, 3, lo, max_tokens=4))
    outs, finish, plans = drive(s, w)
    assert set(finish) == set(loras) and all(f == "length" for f in finish.values())
    per_step = adapters_per_step(plans, loras)
    assert all(len(x) <= 1 for x in per_step)
    # the first step admits a1, skips b1, admits a2 and the base request (vLLM's skip), not c1
    first = {n.request_id for n in plans[0].new}
    assert first == {"a1", "a2", "base"}
    assert {2, 3} <= set().union(*per_step)  # b and c ran later


def test_two_adapters_with_two_slots_share_a_step():
    s, w = make(max_loras=2), Worker()
    loras = {"a": A, "b": B, "c": C, "base": None}
    for rid, lo in loras.items():
        s.add(lreq(rid, 3, lo, max_tokens=3))
    _, finish, plans = drive(s, w)
    assert set(finish) == set(loras)
    assert {n.request_id for n in plans[0].new} == {"a", "b", "base"}
    assert all(len(x) <= 2 for x in adapters_per_step(plans, loras))


def test_prefix_cache_keyed_by_adapter():
    prefix = list(range(20, 36))  # 4 full blocks of 4
    s, w = make(max_loras=2), Worker()
    s.add(lreq("a1", 1, A, prefix))
    drive(s, w)
    for rid, lo, hit in (("a2", A, True), ("b", B, False), ("base", None, False), ("a3", LoraSpec("a", 1, "/a"), True)):
        s.add(lreq(rid, 1, lo, prefix))
        p = s.schedule()
        (nr,) = p.new
        assert nr.lora == lo
        assert (nr.num_computed_tokens > 0) == hit, rid
        s.update(w.run(p))
        drive(s, w)


def test_preempted_request_resumes_with_its_adapter():
    s, w = make(num_blocks=6, block_size=4, max_loras=2), Worker()
    s.add(lreq("a", 8, A, max_tokens=12))
    s.add(lreq("b", 8, B, max_tokens=12))
    _, finish, plans = drive(s, w)
    assert s.num_preemptions > 0 and set(finish) == {"a", "b"}
    resent = [n for p in plans[1:] for n in p.new]
    assert resent and all(n.lora == {"a": A, "b": B}[n.request_id] for n in resent)


def test_request_whose_adapter_failed_on_the_ranks_ends_with_400():
    from axonserve.engine.step import result_problem
    from axonserve.protocol.messages import StepResult

    s, w = make(max_loras=2), Worker()
    s.add(lreq("ok", 3, A))
    s.add(lreq("bad", 3, B))
    plan = s.schedule()
    res = w.run(plan)
    keep = [i for i, rid in enumerate(res.request_ids) if rid != "bad"]
    res = StepResult(
        plan.step_id,
        [res.request_ids[i] for i in keep],
        [res.sampled_token_ids[i] for i in keep],
        failed_request_ids=["bad"],
        failed_errors=["cannot read adapter"],
    )
    assert result_problem(plan, res) is None
    deltas = {d.request_id: d for d in s.update(res)}
    assert deltas["bad"].finish_reason == "error" and deltas["bad"].error_code == 400
    assert deltas["bad"].error == "cannot read adapter" and "bad" not in s.requests
    assert deltas["ok"].finish_reason is None and "ok" in s.requests
    assert "bad" in s.schedule().finished_request_ids  # the ranks drop its state
    bogus = StepResult(plan.step_id, failed_request_ids=["never-planned"], failed_errors=["x"])
    assert result_problem(plan, bogus) is not None


def test_an_adapter_request_publishes_only_blocks_of_returned_plans():
    """An adapter request's rows are skipped when its adapter fails to load, so its blocks enter the
    prefix cache only from results (Scheduler._publish skips it), and with async scheduling only
    those of plans whose result is back: never the next plan's, still in flight."""
    s, w = make(max_loras=1, budget=4, async_scheduling=True), Worker()
    r = lreq("a", 10, A, prefix=list(range(20, 30)))  # 20 tokens: 5 blocks of 4
    s.add(r)
    p1, p2 = s.schedule(), s.schedule()  # both in flight
    assert p1.num_scheduled_tokens == [4] and p2.num_scheduled_tokens == [4]
    assert not s.blocks.cached
    s.update(w.run(p1))
    assert r.num_cached_blocks == 1 and len(s.blocks.cached) == 1
    s.update(w.run(p2))
    assert r.num_cached_blocks == 2 and len(s.blocks.cached) == 2
