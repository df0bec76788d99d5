"""The traffic-driven bucket planner: the 1-D dynamic programme, the budget, the limits, the
shapes the scheduler records, the saved files and the refusal of bad ones."""

from __future__ import annotations

import argparse
import itertools
import json
import random

import pytest

from axonserve.actors.metrics import EngineMetrics
from axonserve.engine.bucket_plan import (
    SERVE_DEFAULTS,
    Traffic,
    _num_kv,
    _num_pairs,
    current_buckets,
    evaluate,
    optimal_buckets,
    plan,
    read_traffic_json,
)
from axonserve.engine.buckets import (
    MAX_BUCKET_FILE_BYTES,
    BucketConfig,
    bucket_shapes,
    read_bucket_file,
    write_bucket_file,
)
from axonserve.protocol.messages import BucketInfo, StepStats

from .test_scheduler import Worker, make, req

LIMITS = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=512, block_size=16)


def skewed_traffic(steps: int = 2000, seed: int = 1) -> Traffic:
    """Mostly short prompts (20-40 tokens), a few long ones, decodes of short contexts, as the
    metrics actor histograms them and /metrics exposes them."""
    rng = random.Random(seed)
    em = EngineMetrics("m")
    for _ in range(steps):
        if rng.random() < 0.3:
            q = [rng.randint(20, 40) if rng.random() < 0.9 else rng.randint(300, 500) for _ in range(rng.randint(1, 4))]
            em.apply(StepStats(num_running=0, num_waiting=0, kv_cache_usage=0, prefill_query_lens=q, prefill_kv_lens=q))
        else:
            kv = [rng.randint(25, 60) for _ in range(rng.randint(1, 12))]
            em.apply(StepStats(num_running=0, num_waiting=0, kv_cache_usage=0, decode_kv_lens=kv))
    em.apply(BucketInfo(**LIMITS))
    t = Traffic.from_exposition(em.render())
    return t


def brute_force(xs, ws, k):
    best = None
    for rest in itertools.combinations(xs[:-1], k - 1):
        bs = [*rest, xs[-1]]
        cost = sum(w * next(b for b in bs if b >= x) for x, w in zip(xs, ws))
        best = cost if best is None else min(best, cost)
    return best


def test_dp_finds_the_known_optimum():
    xs, ws = [10, 20, 30, 40], [5, 1, 5, 0]
    got = optimal_buckets(xs, ws, 8)
    # one bucket: 11 x 40; two: {10, 40} beats {20, 40} and {30, 40}; three: {10, 30, 40}
    assert got == [(440.0, [40]), (290.0, [10, 40]), (230.0, [10, 30, 40]), (220.0, [10, 20, 30, 40])]


def test_dp_matches_brute_force():
    rng = random.Random(3)
    for _ in range(200):
        xs = sorted(rng.sample(range(1, 200), rng.randint(1, 7)))
        ws = [rng.randint(0, 9) for _ in xs]
        for k, (cost, bs) in enumerate(optimal_buckets(xs, ws, 8), start=1):
            assert len(bs) == k and bs[-1] == xs[-1] and bs == sorted(set(bs))
            assert cost == brute_force(xs, ws, k)
            assert cost == sum(w * next(b for b in bs if b >= x) for x, w in zip(xs, ws))


def test_fast_shape_count_equals_bucket_shapes():
    rng = random.Random(0)
    for _ in range(3000):
        cl = sorted(set(rng.randrange(1, 300) for _ in range(rng.randrange(1, 7))))
        dl = sorted(set(rng.randrange(1, 300) for _ in range(rng.randrange(1, 7))))
        max_len = rng.randrange(1, 400)
        shapes = bucket_shapes(BucketConfig((1,), tuple(cl), (1,), tuple(dl)), max_len)
        assert _num_kv(dl, max_len) == sum(s[0] == "decode" for s in shapes)
        assert _num_pairs(cl, dl, max_len) == sum(s[0] == "prefill" for s in shapes)


def test_plan_beats_the_defaults_within_budget_and_covers_the_limits():
    t = skewed_traffic()
    current, t.limits = current_buckets(t, {})
    assert current == BucketConfig.resolve(**LIMITS)  # bucketing was off: the automatic buckets
    p = plan(t, current)
    assert p.budget == p.current_waste.graphs == len(bucket_shapes(current, 512))
    assert p.waste.graphs <= p.budget
    assert p.waste.weighted(p.kv_weight) < p.current_waste.weighted(p.kv_weight)
    assert p.waste.query_tokens < p.current_waste.query_tokens
    for budget in (2, 5, 12, 30, 200):
        q = plan(t, current, budget)
        assert len(bucket_shapes(q.buckets, 512)) == q.waste.graphs <= budget
        for name in ("context_batch", "context_len", "decode_batch", "decode_len"):
            assert getattr(q.buckets, name)[-1] == getattr(current, name)[-1]  # the limits stay covered
        assert all(v % 16 == 0 for v in q.buckets.decode_len)  # whole KV blocks
    # more graphs never waste more
    costs = [plan(t, current, b).waste.weighted(p.kv_weight) for b in (5, 12, 30, 200)]
    assert costs == sorted(costs, reverse=True)
    with pytest.raises(ValueError, match="cannot hold"):
        plan(t, current, 1)


def test_evaluate_counts_padding_exactly_on_a_tiny_trace():
    """Two prefill steps (rows [20] and [20, 40]) and one decode step of 3 rows (KV 30, 50, 70)."""
    em = EngineMetrics("m")
    em.apply(StepStats(num_running=0, num_waiting=0, kv_cache_usage=0, prefill_query_lens=[20], prefill_kv_lens=[20]))
    em.apply(
        StepStats(num_running=0, num_waiting=0, kv_cache_usage=0, prefill_query_lens=[20, 40], prefill_kv_lens=[20, 40])
    )
    em.apply(StepStats(num_running=0, num_waiting=0, kv_cache_usage=0, decode_kv_lens=[30, 50, 70]))
    t = Traffic.from_exposition(em.render())
    b = BucketConfig((1, 2), (32, 64), (4,), (64, 128))
    w = evaluate(t, b)
    # query: rows 32 + 64 + 64 - 80 real; no batch padding in prefill; 1 decode padding row
    assert w.query_tokens == (32 + 64 + 64 - 80) + 1
    # KV: prefill rows 64 + 64 + 64 - 80; decode rows 3 x 128 - 150, padding row at mean k^ 70
    assert w.kv_positions == (3 * 64 - 80) + (3 * 128 - 150) + 70
    assert w.graphs == len(bucket_shapes(b, 128))


def test_scheduler_records_the_shapes_it_plans():
    from axonserve.engine.buckets import BucketConfig as B

    s = make(buckets=B((1, 2, 4), (8, 16, 32), (1, 2, 4, 8), (32, 64, 128)), budget=24)
    w = Worker()
    s.add(req("a", 20))
    s.add(req("b", 3))
    plan = s.schedule()
    assert s.plan_shapes.prefill_q == [20, 3] and s.plan_shapes.prefill_kv == [20, 3]
    assert not s.plan_shapes.decode_kv
    s.update(w.run(plan))
    plan = s.schedule()  # decode first after a prefill step
    assert s.plan_shapes.decode_q == [1, 1] and s.plan_shapes.decode_kv == [21, 4]
    assert not s.plan_shapes.prefill_q


def test_traffic_and_bucket_files_round_trip(tmp_path):
    t = skewed_traffic(300)
    f = tmp_path / "traffic.json"
    f.write_text(json.dumps(t.to_json()))
    assert read_traffic_json(str(f)) == t
    b = BucketConfig((1, 3), (48, 512), (2, 16), (64, 512))
    write_bucket_file(str(tmp_path / "b.json"), b)
    assert read_bucket_file(str(tmp_path / "b.json")) == b.as_dict()


@pytest.mark.parametrize(
    "content, why",
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ("{}", "JSON object"),
        ('{"decode_len": [128], "extra": [1]}', "unknown keys"),
        ('{"decode_len": []}', "list of 1 to"),
        ('{"decode_len": "128"}', "list of 1 to"),
        ('{"decode_len": [0, 128]}', "integers in"),
        ('{"decode_len": [-4]}', "integers in"),
        ('{"decode_len": [true]}', "integers in"),
        ('{"decode_len": [1.5]}', "integers in"),
        ('{"decode_len": [99999999999]}', "integers in"),
        (json.dumps({"decode_len": list(range(1, 66))}), "list of 1 to"),
        ("[" * 100_000 + "]" * 100_000, "larger than|not JSON"),
        (" " * (MAX_BUCKET_FILE_BYTES + 1) + "{}", "larger than"),
    ],
)
def test_bad_bucket_files_are_refused(tmp_path, content, why):
    f = tmp_path / "b.json"
    f.write_text(content)
    with pytest.raises(ValueError, match=why):
        read_bucket_file(str(f))


def test_missing_bucket_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="bucket file"):
        read_bucket_file(str(tmp_path / "nope.json"))


@pytest.mark.parametrize(
    "mutate, why",
    [
        (lambda d: d.update(format="other"), "axonserve-traffic"),
        (lambda d: d["histograms"].update(bogus={}), "histograms"),
        (lambda d: d["histograms"]["step_batch_size"]["decode"].update(counts=[-1]), "counts"),
        (lambda d: d["histograms"]["step_batch_size"]["decode"].update(bounds=[3, 2]), "ascend|counts"),
        (lambda d: d.update(limits={"max_model_len": -5}), "positive"),
        (lambda d: d.update(buckets={"decode_len": [0]}), "integers in"),
    ],
)
def test_bad_traffic_files_are_refused(tmp_path, mutate, why):
    d = skewed_traffic(100).to_json()
    mutate(d)
    f = tmp_path / "t.json"
    f.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=why):
        read_traffic_json(str(f))


def test_cli_plan_from_json_writes_a_bucket_file(tmp_path, capsys):
    from axonserve.cli import main

    t = skewed_traffic(500)
    src, out = tmp_path / "t.json", tmp_path / "b.json"
    src.write_text(json.dumps(t.to_json()))
    with pytest.raises(SystemExit) as e:
        main(["buckets", "plan", "--from-json", str(src), "--budget", "40", "--out", str(out)])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "padded query tokens" in text and "(budget 40)" in text
    lists = read_bucket_file(str(out))
    assert len(bucket_shapes(BucketConfig(**{k: tuple(v) for k, v in lists.items()}), 512)) <= 40


def test_serve_buckets_file_sets_the_lists_and_excludes_the_flags(tmp_path):
    from axonserve.cli import add_engine_args, apply_bucket_file, main

    f = tmp_path / "b.json"
    f.write_text('{"context_batch": [1, 4], "decode_len": [256, 64]}')
    p = argparse.ArgumentParser()
    add_engine_args(p)
    a = p.parse_args(["m", "--buckets", str(f)])
    apply_bucket_file(a)
    assert a.bucketing and a.context_batch_buckets == [1, 4] and a.decode_len_buckets == [64, 256]
    assert a.context_len_buckets == []  # not in the file: automatic
    with pytest.raises(SystemExit) as e:
        main(["serve", "no-such-model", "--buckets", str(f), "--decode-len-buckets", "128"])
    assert e.value.code == 2
    f.write_text('{"decode_len": [0]}')
    with pytest.raises(SystemExit) as e:
        main(["serve", "no-such-model", "--buckets", str(f)])
    assert e.value.code == 2


def test_planner_defaults_are_the_serve_commands():
    from axonserve.cli import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    a = p.parse_args(["m"])
    assert SERVE_DEFAULTS == {k: getattr(a, k) for k in SERVE_DEFAULTS}


def test_step_stats_carry_the_shapes_and_compiles_follow_the_result(monkeypatch):
    """The scheduler's step publisher: the plans' shapes in StepStats, the two steps coalesced
    into one event on flush (each step's sequences by phase in *_seqs; decode queries of one token
    each sent as an empty list), and a CompileStats after a result that reports compiles."""
    import structlog

    from axonserve.engine.buckets import BucketConfig as B
    from axonserve.engine.step import Step, StepStatsPublisher
    from axonserve.protocol.messages import CompileStats

    monkeypatch.setattr("axonserve.engine.step.STATS_INTERVAL_S", 3600.0)  # (a slow box: no early flush)
    s = make(buckets=B((1, 2, 4), (8, 16, 32), (1, 2, 4, 8), (32, 64, 128)), budget=24)
    events: list = []
    publish = StepStatsPublisher(s, events.append, structlog.get_logger())
    w = Worker()
    s.add(req("a", 20))
    s.add(req("b", 3))
    for compiles in ([2.5, 0.25], []):
        plan = s.schedule()
        step = Step(plan, 0.0, 0.0, 0.0, shapes=s.plan_shapes)
        step.result = w.run(plan)
        step.result.compile_s, step.result.compile_cache_hits = compiles, len(compiles)
        s.update(step.result)
        publish(step, 0)
    assert not [e for e in events if isinstance(e, StepStats)]  # (within the interval: gathering)
    publish.flush(0)
    (stats,) = [e for e in events if isinstance(e, StepStats)]
    assert stats.prefill_query_lens == [20, 3] and stats.prefill_kv_lens == [20, 3] and stats.prefill_seqs == [2, 0]
    assert stats.decode_kv_lens == [21, 4] and stats.decode_query_lens == [] and stats.decode_seqs == [0, 2]
    assert stats.num_tokens == [23, 2] and len(stats.forward_s) == 2 and stats.prompt_tokens == 23
    assert [e for e in events if isinstance(e, CompileStats)] == [CompileStats(seconds=[2.5, 0.25], cache_hits=2)]
