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


class ShapeHistograms:
    """Histograms of the shapes served, by phase (prefill / decode), folded in a whole step at a
    time (numpy, one call per list) instead of one `observe` per sequence: a step of 256 decodes
    costs the metrics actor microseconds. A custom collector: a series appears once observed."""

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

    def observe(self, name: str, phase: str, values: list[int]) -> None:
        if not values:
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

    def record(self, ev: StepStats) -> None:
        """One step's shapes, checked whole first (a bad event changes nothing)."""
        phases = (
            ("prefill", ev.prefill_query_lens, ev.prefill_kv_lens),
            ("decode", ev.decode_query_lens or None, ev.decode_kv_lens),
        )
        for _, query, kv in phases:
            if query is not None and len(query) != len(kv):
                raise ValueError("query and KV lengths of different lengths")
            if min(kv, default=0) < 0 or min(query or [0]) < 0:
                raise ValueError("negative query or KV length")
        for phase, query, kv in phases:
            if kv:
                self._step(phase, query, kv)

    def _step(self, phase: str, query: list[int] | None, kv: list[int]) -> None:
        """One step's sequences of one phase (query None: one token each)."""
        n = len(kv)
        if query is None:
            self.observe_n("axonserve:step_query_tokens", phase, 1, n)
            self.observe_n("axonserve:step_max_query_tokens", phase, 1, n)
        else:
            self.observe("axonserve:step_query_tokens", phase, query)
            self.observe_n("axonserve:step_max_query_tokens", phase, max(query), n)
        self.observe("axonserve:step_kv_tokens", phase, kv)
        self.observe_n("axonserve:step_max_kv_tokens", phase, max(kv), n)
        self.observe_n("axonserve:step_batch_size", phase, n, 1)

    def collect(self):
        for name, (doc, _) in SHAPE_HISTOGRAMS.items():
            fam = HistogramMetricFamily(name, doc, labels=["model_name", "phase"])
            les = [floatToGoString(b) for b in self.bounds[name]] + ["+Inf"]
            for (n, phase), counts in sorted(self.counts.items()):
                if n == name:
                    cum = np.cumsum(counts).tolist()
                    fam.add_metric([self.model, phase], list(zip(les, cum)), self.sums[(n, phase)])
            yield fam


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

    def apply(self, ev: object) -> None:
        m = (self.model, str(getattr(ev, "engine", 0)))
        self.events.labels(*m).inc()
        if isinstance(ev, StepStats):
            self.shapes.record(ev)  # (first: it refuses a malformed event before anything counts it)
            self.running.labels(*m).set(ev.num_running)
            self.waiting.labels(*m).set(ev.num_waiting)
            self.kv_usage.labels(*m).set(ev.kv_cache_usage)
            self.prompt_tokens.labels(*m).inc(ev.prompt_tokens)
            self.generation_tokens.labels(*m).inc(ev.generation_tokens)
            self.preemptions.labels(*m).inc(ev.num_preemptions)
            self.prefix_queries.labels(*m).inc(ev.prefix_cache_queries)
            self.prefix_hits.labels(*m).inc(ev.prefix_cache_hits)
            if ev.num_tokens:
                self.iter_tokens.labels(*m).observe(ev.num_tokens)
            self.forwards.labels(*m).inc(ev.num_forwards)
            for v in ev.ttft_s:
                self.ttft.labels(*m).observe(v)
            for v in ev.itl_s:
                self.itl.labels(*m).observe(v)
            if ev.spec_drafts:
                self.spec_drafts.labels(*m).inc(ev.spec_drafts)
                self.spec_draft_tokens.labels(*m).inc(ev.spec_draft_tokens)
                self.spec_accepted.labels(*m).inc(ev.spec_accepted_tokens)
                for pos, n in enumerate(ev.spec_accepted_per_pos):
                    self.spec_per_pos.labels(*m, str(pos)).inc(n)
            for phase in STEP_PHASES:
                self.step_time.labels(*m, phase).observe(getattr(ev, f"{phase}_s"))
            self.dropped.labels(*m, "scheduler").set(ev.dropped)
        elif isinstance(ev, RequestStats):
            self.success.labels(*m, ev.finish_reason).inc()
            self.e2e.labels(*m).observe(ev.e2e_s)
            self.queue.labels(*m).observe(ev.queue_s)
            self.req_prompt.labels(*m).observe(ev.prompt_tokens)
            self.req_gen.labels(*m).observe(ev.generation_tokens)
            self.prefill.labels(*m).observe(ev.prefill_s)
            self.decode.labels(*m).observe(ev.decode_s)
            if ev.generation_tokens > 1:
                self.tpot.labels(*m).observe(ev.decode_s / (ev.generation_tokens - 1))
        elif isinstance(ev, EncoderStats):
            self.mm_images.labels(*m).inc(ev.images)
            self.mm_cache_hits.labels(*m).inc(ev.cache_hits)
            self.mm_encode.labels(*m).inc(ev.encode_s)
            self.mm_retries.labels(*m).inc(ev.retries)
        elif isinstance(ev, CompileStats):
            if not all(0 <= s < math.inf for s in ev.seconds) or ev.cache_hits < 0:
                raise ValueError(f"impossible compile stats {ev}")
            self.xla_compiles.labels(*m).inc(len(ev.seconds))
            for s in ev.seconds:
                self.xla_compile_s.labels(*m).observe(s)
            self.xla_cache_hits.labels(*m).inc(ev.cache_hits)
        elif isinstance(ev, RestartStats):
            if not 0 <= ev.seconds < math.inf or ev.requests_resumed < 0 or len(ev.actor) > 64:
                raise ValueError(f"impossible restart stats {ev}")
            if ev.actor:
                self.restarts.labels(*m, ev.actor).inc()
                self.restart_s.labels(*m).observe(ev.seconds)
            self.resumed.labels(*m).inc(ev.requests_resumed)
        elif isinstance(ev, BucketInfo):
            self.buckets.labels(*m).info(
                {
                    f: ",".join(map(str, v)) if isinstance(v, list) else str(v)
                    for f in BucketInfo.__struct_fields__
                    if f != "engine"  # (a label)
                    for v in [getattr(ev, f)]
                }
            )
        elif isinstance(ev, ActorAlive):
            self.alive.labels(*m, ev.actor).set(time.time())
            self.dropped.labels(*m, ev.actor).set(ev.dropped)

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
