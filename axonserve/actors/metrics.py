"""Metrics actor: aggregates every actor's stats events into Prometheus metrics.

Actors push events without waiting (dropped and counted under back-pressure), so metrics
never slow a step loop. Names follow vLLM's (`vllm:*`) so existing Grafana dashboards work;
our own extras are `axonserve:*`. The text exposition is served over the bus (`GetMetrics`
-> `MetricsText`), which the HTTP frontend proxies at `/metrics`.
"""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from axonserve.actors.runtime import SMALL_MESSAGE_BYTES, Actor
from axonserve.protocol import Codec
from axonserve.protocol.messages import (
    ActorAlive,
    BucketInfo,
    CompileStats,
    EncoderStats,
    GetMetrics,
    MetricsText,
    RequestStats,
    RestartStats,
    StatsEvent,
    StepStats,
)

_stats_codec = Codec(StatsEvent)
_query_codec = Codec(GetMetrics)

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# a step's timeline: schedule -> send (plan out) -> [worker: forward, sample] -> return (the
# rest of the round trip: transit both ways, worker bookkeeping) -> update (apply, send outputs);
# roundtrip = send + forward + sample + return
STEP_PHASES = ("schedule", "send", "forward", "sample", "return", "update", "roundtrip")
STEP_BUCKETS = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)


# an XLA graph compiles in tens of milliseconds (tiny) to minutes (a large model's prefill)
COMPILE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 180.0, 300.0, 450.0, 600.0)


def _octaves(start: int, stop: int, per: int = 4) -> list[int]:
    """`per` evenly spaced integer boundaries per octave above start, up to stop (powers of two
    included), e.g. 512 -> 640, 768, 896, 1024, 1280, ..."""
    out, lo = [], start
    while lo < stop:
        out += [lo + lo * i // per for i in range(1, per + 1)]
        lo *= 2
    return out


# Fixed, fine boundaries for the shapes served: `axonserve buckets plan` picks bucket sizes among
# them, so they must not depend on the traffic. Tokens: 1, 2, 4, 8, multiples of 16 up to 512,
# then 4 per octave up to 131072. Batch sizes: every size up to 16, then 4 per octave up to 1024.
TOKEN_BOUNDS = (1, 2, 4, 8, *range(16, 513, 16), *_octaves(512, 131072))
BATCH_BOUNDS = (*range(1, 17), *_octaves(16, 1024))
SHAPE_HISTOGRAMS = {  # name -> (help, boundaries)
    "axonserve:step_query_tokens": ("Tokens a sequence computes in a step (its query length)", TOKEN_BOUNDS),
    "axonserve:step_kv_tokens": ("KV length of a sequence in a step (computed + scheduled tokens)", TOKEN_BOUNDS),
    "axonserve:step_batch_size": ("Sequences in a step", BATCH_BOUNDS),
    "axonserve:step_max_query_tokens": (
        "A step's longest query, counted once per sequence in it (what each row pads to before bucketing)",
        TOKEN_BOUNDS,
    ),
    "axonserve:step_max_kv_tokens": (
        "A step's longest KV length, counted once per sequence in it (what each row pads to before bucketing)",
        TOKEN_BOUNDS,
    ),
}


# bounds on what one stats event may hold (events come from a socket anyone local can reach): the
# scheduler's publisher sends at most STATS_MAX_STEPS steps an event (engine/step.py), lengths
# are far below 2^31 tokens, label values are short and engines few
MAX_EVENT_STEPS = 4096
MAX_EVENT_REQUESTS = 1 << 18
MAX_SHAPE = 2**31
MAX_LABEL_CHARS = 64
MAX_ENGINES = 1024
MAX_SPEC_POSITIONS = 64
# StepStats' counters (deltas) -> EngineMetrics' Counter
STEP_COUNTERS = (
    ("prompt_tokens", "prompt_tokens"),
    ("generation_tokens", "generation_tokens"),
    ("num_preemptions", "preemptions"),
    ("prefix_cache_queries", "prefix_queries"),
    ("prefix_cache_hits", "prefix_hits"),
    ("num_forwards", "forwards"),
)


def observe_many(children: list, bounds: np.ndarray, rows: np.ndarray) -> None:
    """`children[r].observe(v)` for every v of `rows[r]` (labelled children of one prometheus
    Histogram; finite values, checked by the caller) in one numpy pass: bucket counts by
    searchsorted + bincount (`le` inclusive, like observe's `v <= bound`), each sum by a cumsum,
    which adds in order: the very float that one observe at a time gives. `bounds`: the
    histogram's upper bounds, +Inf last. (Reaches into prometheus_client's Histogram child, its
    `_buckets` and `_sum` values; tests/actors/test_metrics.py pins the rendered text.)"""
    nb = len(bounds)
    idx = np.searchsorted(bounds, rows) + nb * np.arange(len(rows))[:, None]
    counts = np.bincount(idx.ravel(), minlength=nb * len(rows))
    for i in np.flatnonzero(counts).tolist():
        children[i // nb]._buckets[i % nb].inc(int(counts[i]))
    start = np.array([[c._sum.get()] for c in children], dtype=np.float64)
    for c, total in zip(children, np.cumsum(np.hstack((start, rows)), axis=1)[:, -1].tolist()):
        c._sum.set(total)


def _times(values: list[float]) -> np.ndarray:
    """Durations as an array, or ValueError unless every one is finite and >= 0."""
    a = np.asarray(values, dtype=np.float64)
    if a.size and not (np.isfinite(a).all() and a.min() >= 0):
        raise ValueError("a negative or non-finite duration")
    return a


class ShapeHistograms:
    """Histograms of the shapes served, by phase (prefill / decode), folded in all the steps of
    an event at a time (numpy, one call per list) instead of one `observe` per sequence: a step
    of 256 decodes costs the metrics actor microseconds. A custom collector: a series appears
    once observed."""

    def __init__(self, model: str):
        self.model = model
        self.bounds = {name: np.asarray(b, dtype=np.int64) for name, (_, b) in SHAPE_HISTOGRAMS.items()}
        self.counts: dict[tuple[str, str], np.ndarray] = {}
        self.sums: dict[tuple[str, str], int] = {}

    def _series(self, name: str, phase: str) -> np.ndarray:
        key = (name, phase)
        if key not in self.counts:
            self.counts[key] = np.zeros(len(self.bounds[name]) + 1, dtype=np.int64)
            self.sums[key] = 0
        return self.counts[key]

    def observe(self, name: str, phase: str, values: list[int] | np.ndarray) -> None:
        if not len(values):
            return
        v = np.asarray(values, dtype=np.int64)
        if v.min() < 0:
            raise ValueError(f"{name}: negative value")
        counts = self._series(name, phase)
        counts += np.bincount(np.searchsorted(self.bounds[name], v), minlength=len(counts))
        self.sums[(name, phase)] += int(v.sum())

    def observe_n(self, name: str, phase: str, value: int, n: int) -> None:
        """`value` observed n times."""
        if value < 0 or n < 0:
            raise ValueError(f"{name}: negative value")
        self._series(name, phase)[np.searchsorted(self.bounds[name], value)] += n
        self.sums[(name, phase)] += value * n

    def observe_weighted(self, name: str, phase: str, values: np.ndarray, n: np.ndarray) -> None:
        """Each `values[i]` observed n[i] times (non-negative, checked by the caller)."""
        counts = self._series(name, phase)
        idx = np.searchsorted(self.bounds[name], values)
        counts += np.bincount(idx, weights=n, minlength=len(counts)).astype(np.int64)
        self.sums[(name, phase)] += int(np.dot(values, n))

    def record(self, ev: StepStats) -> None:
        """The shapes of the event's steps, checked whole first (a bad event changes nothing)."""
        phases = []
        for phase, query, kv, seqs in (
            ("prefill", ev.prefill_query_lens, ev.prefill_kv_lens, ev.prefill_seqs),
            ("decode", ev.decode_query_lens or None, ev.decode_kv_lens, ev.decode_seqs),
        ):
            phases.append((phase, *self.check(query, kv, seqs)))
        for phase, query, kv, seqs in phases:
            if kv.size:
                self._steps(phase, query, kv, seqs)

    @staticmethod
    def check(query: list[int] | None, kv: list[int], seqs: list[int]) -> tuple:
        """One phase's lists as arrays, or ValueError: lengths that disagree, a negative or
        impossible length, more steps than an event may hold."""
        if query is not None and len(query) != len(kv):
            raise ValueError("query and KV lengths of different lengths")
        if len(seqs) > MAX_EVENT_STEPS:
            raise ValueError(f"{len(seqs)} steps in one event (at most {MAX_EVENT_STEPS})")
        k = np.asarray(kv, dtype=np.int64)
        q = None if query is None else np.asarray(query, dtype=np.int64)
        n = np.asarray(seqs if seqs else [len(kv)], dtype=np.int64)
        for a in (k, n) if q is None else (k, n, q):
            if a.size and (a.min() < 0 or a.max() > MAX_SHAPE):
                raise ValueError("negative or impossible query or KV length")
        if int(n.sum()) != len(kv):
            raise ValueError("sequences per step do not add up to the shape lists")
        return q, k, n[n > 0]

    def _steps(self, phase: str, query: np.ndarray | None, kv: np.ndarray, seqs: np.ndarray) -> None:
        """Several steps' sequences of one phase (`seqs`: how many each step has, none 0; query
        None: one token each); each step's longest counts once per sequence in it."""
        total = len(kv)
        starts = np.concatenate(([0], np.cumsum(seqs)[:-1]))
        if query is None:
            self.observe_n("axonserve:step_query_tokens", phase, 1, total)
            self.observe_n("axonserve:step_max_query_tokens", phase, 1, total)
        else:
            self.observe("axonserve:step_query_tokens", phase, query)
            self.observe_weighted("axonserve:step_max_query_tokens", phase, np.maximum.reduceat(query, starts), seqs)
        self.observe("axonserve:step_kv_tokens", phase, kv)
        self.observe_weighted("axonserve:step_max_kv_tokens", phase, np.maximum.reduceat(kv, starts), seqs)
        self.observe("axonserve:step_batch_size", phase, seqs)

    def collect(self):
        for name, (doc, _) in SHAPE_HISTOGRAMS.items():
            fam = HistogramMetricFamily(name, doc, labels=["model_name", "phase"])
            les = [floatToGoString(b) for b in self.bounds[name]] + ["+Inf"]
            for (n, phase), counts in sorted(self.counts.items()):
                if n == name:
                    cum = np.cumsum(counts).tolist()
                    fam.add_metric([self.model, phase], list(zip(les, cum)), self.sums[(n, phase)])
            yield fam


def _check_request(ev: RequestStats) -> None:
    """ValueError unless a finished request's figures are possible (a short reason: a label)."""
    times = (ev.e2e_s, ev.queue_s, ev.prefill_s, ev.decode_s)
    if len(ev.finish_reason) > MAX_LABEL_CHARS or not all(math.isfinite(t) for t in times):
        raise ValueError("impossible request stats")
    if min(ev.prompt_tokens, ev.generation_tokens, ev.cached_tokens, ev.max_tokens) < 0:
        raise ValueError("a negative token count in request stats")


def build_1_2_5(limit: int) -> list[int]:
    out, m = [], 1
    while True:
        for k in (1, 2, 5):
            if k * m > limit:
                return out
            out.append(k * m)
        m *= 10


class EngineMetrics:
    """The registry and every metric; `apply(event)` folds one stats event in."""

    def __init__(self, model_name: str, max_model_len: int = 8192):
        r = self.registry = CollectorRegistry()
        lbl = ["model_name", "engine"]  # engine: the data-parallel engine the figure is from (vLLM's label)
        self.model = model_name
        g = lambda n, d, extra=(): Gauge(n, d, lbl + list(extra), registry=r)  # noqa: E731
        c = lambda n, d, extra=(): Counter(n, d, lbl + list(extra), registry=r)  # noqa: E731
        h = lambda n, d, b: Histogram(n, d, lbl, buckets=b, registry=r)  # noqa: E731
        self.running = g("vllm:num_requests_running", "Requests in the running batch")
        self.waiting = g("vllm:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = g("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full)")
        self.prompt_tokens = c("vllm:prompt_tokens", "Prefill tokens processed")
        self.generation_tokens = c("vllm:generation_tokens", "Generated tokens")
        self.preemptions = c("vllm:num_preemptions", "Preemptions")
        self.prefix_queries = c("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = c("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.success = c("vllm:request_success", "Finished requests", ["finished_reason"])
        self.ttft = h("vllm:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = h("vllm:inter_token_latency_seconds", "Inter-token latency", ITL_BUCKETS)
        self.tpot = h("vllm:time_per_output_token_seconds", "Time per output token", ITL_BUCKETS)
        self.e2e = h("vllm:e2e_request_latency_seconds", "End-to-end request latency", E2E_BUCKETS)
        self.queue = h("vllm:request_queue_time_seconds", "Time waiting before first schedule", E2E_BUCKETS)
        self.prefill = h("vllm:request_prefill_time_seconds", "Prefill phase time", E2E_BUCKETS)
        self.decode = h("vllm:request_decode_time_seconds", "Decode phase time", E2E_BUCKETS)
        tok_buckets = build_1_2_5(max_model_len)
        self.req_prompt = h("vllm:request_prompt_tokens", "Prompt tokens per request", tok_buckets)
        self.req_gen = h("vllm:request_generation_tokens", "Generated tokens per request", tok_buckets)
        self.iter_tokens = h("vllm:iteration_tokens_total", "Tokens per engine step", tok_buckets)
        self.spec_drafts = c("vllm:spec_decode_num_drafts", "Verifications of draft tokens (one per request-step)")
        self.spec_draft_tokens = c("vllm:spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_accepted = c("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.spec_per_pos = c(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position", ["position"]
        )
        self.step_time = Histogram(
            "axonserve:step_phase_seconds", "Step time by phase", lbl + ["phase"], buckets=STEP_BUCKETS, registry=r
        )
        self.alive = g("axonserve:actor_last_seen_timestamp_seconds", "Last stats heartbeat", ["actor"])
        self.dropped = g("axonserve:stats_events_dropped", "Stats events dropped under back-pressure", ["actor"])
        self.events = c("axonserve:stats_events", "Stats events received")
        self.forwards = c(
            "axonserve:model_forwards",
            "Model forwards the worker ranks ran (a multi-step plan runs "
            "several; vllm:iteration_tokens_total counts plans)",
        )
        self.mm_images = c("axonserve:mm_images", "Images sent to the encoder router")
        self.mm_cache_hits = c("axonserve:mm_encoder_cache_hits", "Images served from the encoder cache")
        self.mm_encode = c("axonserve:mm_encode_seconds", "Time encoder jobs took (dispatch to features)")
        self.mm_retries = c("axonserve:mm_encode_retries", "Encoder jobs re-sent after their encoder died")
        self.xla_compiles = c("axonserve:xla_compiles", "XLA graph compilations (worker rank 0)")
        self.xla_compile_s = h("axonserve:xla_compile_seconds", "Time each XLA graph compilation took", COMPILE_BUCKETS)
        self.xla_cache_hits = c(
            "axonserve:xla_compile_cache_hits", "XLA graphs loaded from the persistent compile cache instead"
        )
        # self-healing: restarts by actor ("workers": a rank group), and requests resumed after one.
        # (A restarted metrics actor starts every counter again from 0: Prometheus' rate() and increase()
        # take a counter reset as one)
        self.restarts = c("axonserve:actor_restarts", "Actors replaced after dying or hanging", ["actor"])
        self.restart_s = h(
            "axonserve:actor_restart_seconds", "Time from a failure to its replacement ready", COMPILE_BUCKETS
        )
        self.resumed = c("axonserve:requests_resumed", "In-flight requests resumed after a restart")
        self.resumed.labels(model_name, "0")
        for m in (self.xla_compiles, self.xla_compile_s, self.xla_cache_hits):
            m.labels(model_name, "0")  # at 0 from the start: a dashboard tells "none yet" from "not exported"
        self.shapes = ShapeHistograms(model_name)
        r.register(self.shapes)
        self.buckets = Info(
            "axonserve:buckets", "Engine limits and the buckets in force (empty: bucketing off)", lbl, registry=r
        )
        self._children: dict[tuple, object] = {}
        # histograms observed in bulk (observe_many): their upper bounds, +Inf last
        self._bounds = {h: np.asarray(h._upper_bounds) for h in (self.iter_tokens, self.ttft, self.itl, self.step_time)}

    def child(self, metric: object, engine: str, *extra: str) -> object:
        """`metric.labels(model, engine, *extra)`, made once and kept: `labels` takes a lock and
        builds a key each call, and a StepStats touches ~25 children."""
        key = (metric, engine, *extra)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(self.model, engine, *extra)  # type: ignore[attr-defined]
        return c

    def apply(self, ev: object) -> None:
        engine = getattr(ev, "engine", 0)
        if not 0 <= engine < MAX_ENGINES:
            raise ValueError(f"engine {engine} out of range")
        e = str(engine)
        self.child(self.events, e).inc()
        if isinstance(ev, StepStats):
            self._step_stats(ev, e)  # (checks the whole event before anything counts it)
        elif isinstance(ev, RequestStats):
            _check_request(ev)
            self._request(ev, e)
        elif isinstance(ev, EncoderStats):
            self.child(self.mm_images, e).inc(ev.images)
            self.child(self.mm_cache_hits, e).inc(ev.cache_hits)
            self.child(self.mm_encode, e).inc(ev.encode_s)
            self.child(self.mm_retries, e).inc(ev.retries)
        elif isinstance(ev, CompileStats):
            if not all(0 <= s < math.inf for s in ev.seconds) or ev.cache_hits < 0:
                raise ValueError(f"impossible compile stats {ev}")
            self.child(self.xla_compiles, e).inc(len(ev.seconds))
            for s in ev.seconds:
                self.child(self.xla_compile_s, e).observe(s)
            self.child(self.xla_cache_hits, e).inc(ev.cache_hits)
        elif isinstance(ev, RestartStats):
            if not 0 <= ev.seconds < math.inf or ev.requests_resumed < 0 or len(ev.actor) > MAX_LABEL_CHARS:
                raise ValueError(f"impossible restart stats {ev}")
            if ev.actor:
                self.child(self.restarts, e, ev.actor).inc()
                self.child(self.restart_s, e).observe(ev.seconds)
            self.child(self.resumed, e).inc(ev.requests_resumed)
        elif isinstance(ev, BucketInfo):
            self.child(self.buckets, e).info(
                {
                    f: ",".join(map(str, v)) if isinstance(v, list) else str(v)
                    for f in BucketInfo.__struct_fields__
                    if f != "engine"  # (a label)
                    for v in [getattr(ev, f)]
                }
            )
        elif isinstance(ev, ActorAlive):
            if len(ev.actor) > MAX_LABEL_CHARS:
                raise ValueError("actor name too long")
            self.child(self.alive, e, ev.actor).set(time.time())
            self.child(self.dropped, e, ev.actor).set(ev.dropped)

    def _step_stats(self, ev: StepStats, e: str) -> None:
        """The scheduler's steps since its last event (engine/step.py coalesces them): checked
        whole first (a malformed or impossible event changes nothing), then each list observed
        in one numpy pass."""
        n = len(ev.num_tokens)
        counts = [getattr(ev, f) for f, _ in STEP_COUNTERS] + [
            ev.spec_drafts,
            ev.spec_draft_tokens,
            ev.spec_accepted_tokens,
        ]
        if n > MAX_EVENT_STEPS or len(ev.finished) > MAX_EVENT_REQUESTS:
            raise ValueError(f"{n} steps or {len(ev.finished)} requests in one event")
        if len(ev.spec_accepted_per_pos) > MAX_SPEC_POSITIONS:
            raise ValueError("accepted draft tokens of too many positions")
        if min(counts) < 0 or min(ev.num_tokens, default=0) < 0 or min(ev.spec_accepted_per_pos, default=0) < 0:
            raise ValueError("a negative count")
        phases = [getattr(ev, f"{p}_s") for p in STEP_PHASES]
        if any(len(x) != n for x in phases):
            raise ValueError("per-step lists of different lengths")
        times, ttft, itl = _times(phases), _times(ev.ttft_s), _times(ev.itl_s)
        tokens = np.asarray(ev.num_tokens, dtype=np.int64)
        for r in ev.finished:
            _check_request(r)
        self.shapes.record(ev)  # (checks its lists whole before it counts any)
        c = self.child
        c(self.running, e).set(ev.num_running)
        c(self.waiting, e).set(ev.num_waiting)
        c(self.kv_usage, e).set(ev.kv_cache_usage)
        for f, metric in STEP_COUNTERS:
            c(getattr(self, metric), e).inc(getattr(ev, f))
        tokens = tokens[tokens != 0]
        for h, values in ((self.iter_tokens, tokens), (self.ttft, ttft), (self.itl, itl)):
            if values.size:
                observe_many([c(h, e)], self._bounds[h], values[None])
        if ev.spec_drafts:
            c(self.spec_drafts, e).inc(ev.spec_drafts)
            c(self.spec_draft_tokens, e).inc(ev.spec_draft_tokens)
            c(self.spec_accepted, e).inc(ev.spec_accepted_tokens)
            for pos, k in enumerate(ev.spec_accepted_per_pos):
                c(self.spec_per_pos, e, str(pos)).inc(k)
        if n:
            observe_many([c(self.step_time, e, p) for p in STEP_PHASES], self._bounds[self.step_time], times)
        c(self.dropped, e, "scheduler").set(ev.dropped)
        for r in ev.finished:
            self._request(r, e)

    def _request(self, ev: RequestStats, e: str) -> None:
        """A finished request (checked by `_check_request`)."""
        c = self.child
        c(self.success, e, ev.finish_reason).inc()
        c(self.e2e, e).observe(ev.e2e_s)
        c(self.queue, e).observe(ev.queue_s)
        c(self.req_prompt, e).observe(ev.prompt_tokens)
        c(self.req_gen, e).observe(ev.generation_tokens)
        c(self.prefill, e).observe(ev.prefill_s)
        c(self.decode, e).observe(ev.decode_s)
        if ev.generation_tokens > 1:
            c(self.tpot, e).observe(ev.decode_s / (ev.generation_tokens - 1))

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class MetricsActor(Actor):
    kind = "metrics"

    async def setup(self) -> dict:
        self.pull = self.socket(zmq.PULL, self.addresses.stats, bind=True, max_bytes=SMALL_MESSAGE_BYTES)
        self.query = self.socket(zmq.ROUTER, self.addresses.metrics, bind=True, max_bytes=SMALL_MESSAGE_BYTES)
        name = self.config.served_model_name or self.config.model
        self.metrics = EngineMetrics(name, self.config.max_model_len or 8192)
        return {}

    async def run(self) -> None:
        await asyncio.gather(self._ingest(), self._serve())

    async def _ingest(self) -> None:
        async for ev, _ in self.messages(self.pull, _stats_codec, "stats event"):
            try:
                self.metrics.apply(ev)
            except (ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
                self.dropped("stats event", e)  # well-formed, impossible values (a negative counter increment)

    async def _serve(self) -> None:
        async for _, _, ident in self.messages(self.query, _query_codec, "metrics query", routed=True):
            await self.query.send_multipart([ident, *Codec.encode(MetricsText(self.metrics.render()))])
