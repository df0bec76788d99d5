"""Traffic-driven bucket planning: `axonserve buckets plan`.

Why: a static-shape engine (Neuron, XLA) compiles one graph per bucket shape and pads every step
up to one, and the automatic power-of-two buckets know nothing of the traffic. The metrics actor
histograms the shapes actually served, on fixed fine boundaries (`actors/metrics.py`
SHAPE_HISTOGRAMS); this module reads them back (a Prometheus exposition, or the JSON it saves)
and proposes the four bucket lists of `engine/buckets.py` that waste the least padding on that
traffic within a budget of compiled graphs.

The waste model, the same for the buckets in force and for the plan. A step pads every row to its
longest member before bucketing, so rows are counted at their step's longest query q^ and KV
length k^ (the `step_max_*` histograms); Q, S, B are the buckets picked:

* padded query tokens = sum over prefill rows of Q(q^), minus the real query tokens, plus each
  padding row of a prefill step at the mean q^ of a prefill row, plus each padding row of a
  decode step at 1 (a decode row computes one token: no query padding);
* padded KV positions = sum over rows of S(k^), minus the real KV lengths, plus each padding row
  at the mean k^ of its phase;
* weighted waste = padded query tokens + kv_weight x padded KV positions. A padded query token
  runs a row through every weight, a padded KV position only reads one position's K and V, so
  KV_WEIGHT is small (see there).

A value is known up to its histogram bin and taken at the bin's upper bound (exact when every
bucket is a bin boundary, as the plan's and the automatic ones are). Pricing padding rows at the
unpadded mean row keeps each dimension's waste a function of its own buckets, so each dimension
is optimised alone (dynamic programming over the bin boundaries, for every bucket count), then the
counts are chosen together under the budget, counted exactly as `buckets.bucket_shapes` lists the
graphs. The largest bucket of each dimension stays the one in force (the engine limits); traffic
beyond it (served without bucketing) is counted at it.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import structlog

from axonserve.engine.buckets import (
    DIMENSIONS,
    MAX_BUCKETS_PER_LIST,
    BucketConfig,
    bucket_shapes,
    check_bucket_lists,
    read_json_file,
    write_bucket_file,
)

log = structlog.get_logger(__name__)

# A padded KV position reads one position's K and V in every layer; a padded query token moves a
# row through every weight. For decode the per-row share of the weight traffic is some hundreds
# of times one position's KV (SmolLM2-135M at batch 32: ~8.4 MB of weights per row against 23 KB
# of bf16 KV per position), so 1/256 is the order of magnitude; --kv-weight sets it per model.
KV_WEIGHT = 1 / 256
PHASES = ("prefill", "decode")
HISTOGRAMS = ("step_query_tokens", "step_kv_tokens", "step_batch_size", "step_max_query_tokens", "step_max_kv_tokens")
LIMITS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size")
SERVE_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 2048, "block_size": 16}  # `axonserve serve`'s
TRAFFIC_FORMAT = "axonserve-traffic/1"
MAX_TRAFFIC_BYTES = 64 * 2**20  # a scrape or a saved traffic file
MAX_BINS = 1024


@dataclass
class Hist:
    """One histogram series: finite upper bounds (ascending), the count in each bin (the last:
    above every bound), and the sum of the values."""

    bounds: list[float]
    counts: list[int]
    sum: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.counts)

    def points(self) -> list[tuple[float, int]]:
        """(upper bound, count) of each non-empty bin (the last bin's bound is +inf)."""
        ubs = [*self.bounds, math.inf]
        return [(ub, c) for ub, c in zip(ubs, self.counts) if c]


@dataclass
class Traffic:
    """The shapes an engine served (histograms by name and phase), with its limits and the
    buckets in force when it says (empty: unknown, or bucketing off)."""

    hists: dict[str, dict[str, Hist]] = field(default_factory=dict)
    limits: dict[str, int] = field(default_factory=dict)
    buckets: dict[str, list[int]] = field(default_factory=dict)

    def hist(self, name: str, phase: str) -> Hist | None:
        return self.hists.get(name, {}).get(phase)

    def sum(self, name: str, phase: str) -> float:
        h = self.hist(name, phase)
        return h.sum if h else 0.0

    def count(self, name: str, phase: str) -> int:
        h = self.hist(name, phase)
        return h.total if h else 0

    # ------------------------------------------------------------------ reading and saving

    @classmethod
    def from_exposition(cls, text: str) -> Traffic:
        """From a Prometheus text exposition (our /metrics); series of several model names add up."""
        from prometheus_client.parser import text_string_to_metric_families

        cum: dict[tuple[str, str], dict[float, float]] = {}
        sums: dict[tuple[str, str], float] = {}
        out = cls()
        for fam in text_string_to_metric_families(text):
            name = fam.name.removeprefix("axonserve:")
            if fam.name.startswith("axonserve:") and name in HISTOGRAMS:
                for s in fam.samples:
                    key = (name, s.labels.get("phase", ""))
                    if s.name.endswith("_bucket"):
                        le = float(s.labels["le"])
                        d = cum.setdefault(key, {})
                        d[le] = d.get(le, 0.0) + s.value
                    elif s.name.endswith("_sum"):
                        sums[key] = sums.get(key, 0.0) + s.value
            elif fam.name in ("axonserve:buckets", "axonserve:buckets_info"):
                for s in fam.samples:
                    out._info({k: v for k, v in s.labels.items() if k != "model_name"})
        for (name, phase), d in cum.items():
            if phase not in PHASES:
                continue
            les = sorted(d)
            if not les or les[-1] != math.inf or len(les) > MAX_BINS + 1:
                raise ValueError(f"histogram {name}{{phase={phase}}} has no +Inf bucket or too many")
            c = [int(round(d[le])) for le in les]
            counts = [c[0]] + [b - a for a, b in zip(c, c[1:])]
            if min(counts) < 0:
                raise ValueError(f"histogram {name}{{phase={phase}}} is not cumulative")
            out.hists.setdefault(name, {})[phase] = Hist(les[:-1], counts, sums.get((name, phase), 0.0))
        return out

    def _info(self, labels: dict[str, str]) -> None:
        """The engine's limits and buckets from the axonserve:buckets_info labels."""
        try:
            self.limits = {k: int(labels[k]) for k in LIMITS if labels.get(k)}
            lists = {k: [int(x) for x in labels[k].split(",")] for k in DIMENSIONS if labels.get(k)}
        except ValueError as e:
            raise ValueError(f"axonserve:buckets_info: {e}") from None
        self.buckets = check_bucket_lists(lists, "axonserve:buckets_info") if lists else {}

    def to_json(self) -> dict:
        return {
            "format": TRAFFIC_FORMAT,
            "histograms": {
                n: {p: {"bounds": h.bounds, "counts": h.counts, "sum": h.sum} for p, h in by.items()}
                for n, by in self.hists.items()
            },
            "limits": self.limits,
            "buckets": self.buckets,
        }

    @classmethod
    def from_json(cls, data: object) -> Traffic:
        """From `to_json`'s form, checked (a file is input like any other)."""
        if not isinstance(data, dict) or data.get("format") != TRAFFIC_FORMAT:
            raise ValueError(f"not an {TRAFFIC_FORMAT} file")
        out = cls()
        hists = data.get("histograms")
        if not isinstance(hists, dict) or not set(hists) <= set(HISTOGRAMS):
            raise ValueError(f"histograms: expected an object with some of {', '.join(HISTOGRAMS)}")
        for name, by in hists.items():
            if not isinstance(by, dict) or not set(by) <= set(PHASES):
                raise ValueError(f"histograms.{name}: expected an object by phase ({', '.join(PHASES)})")
            for phase, h in by.items():
                out.hists.setdefault(name, {})[phase] = _check_hist(h, f"histograms.{name}.{phase}")
        limits = data.get("limits", {})
        if not isinstance(limits, dict) or not set(limits) <= set(LIMITS):
            raise ValueError(f"limits: expected an object with some of {', '.join(LIMITS)}")
        if not all(type(v) is int and 1 <= v <= 1 << 24 for v in limits.values()):
            raise ValueError("limits: positive integers expected")
        out.limits = dict(limits)
        buckets = data.get("buckets", {})
        out.buckets = check_bucket_lists(buckets, "buckets") if buckets else {}
        return out


def _check_hist(h: object, what: str) -> Hist:
    if not isinstance(h, dict) or set(h) != {"bounds", "counts", "sum"}:
        raise ValueError(f"{what}: expected bounds, counts and sum")
    bounds, counts, total = h["bounds"], h["counts"], h["sum"]
    if not isinstance(bounds, list) or not isinstance(counts, list) or not 1 <= len(bounds) <= MAX_BINS:
        raise ValueError(f"{what}: bounds and counts must be lists (at most {MAX_BINS} bounds)")
    if not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b < math.inf for b in bounds):
        raise ValueError(f"{what}: bounds must be positive numbers")
    if any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"{what}: bounds must ascend")
    if len(counts) != len(bounds) + 1 or not all(type(c) is int and 0 <= c < 1 << 62 for c in counts):
        raise ValueError(f"{what}: counts must be len(bounds) + 1 non-negative integers")
    if not isinstance(total, (int, float)) or isinstance(total, bool) or not 0 <= total < math.inf:
        raise ValueError(f"{what}: sum must be a non-negative number")
    return Hist([float(b) for b in bounds], list(counts), float(total))


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Waste:
    query_tokens: float  # padded query tokens
    kv_positions: float  # padded KV positions
    graphs: int  # compiled shapes (len(bucket_shapes))

    def weighted(self, kv_weight: float) -> float:
        return self.query_tokens + kv_weight * self.kv_positions


@dataclass(frozen=True)
class _Dim:
    """One bucket dimension as the planner sees it: candidate values (ascending, the largest the
    required cap) with the number of observations each must cover, and the (query, KV) price of
    one unit of bucket size above the value."""

    xs: list[int]
    ws: list[int]
    unit: tuple[float, float]
    real: float  # sum of the values themselves (subtracted: waste = padded - real)


def _dims(t: Traffic, base: BucketConfig) -> dict[str, _Dim]:
    block = t.limits.get("block_size") or 1

    def points(hists: list[Hist | None], cap: int, step: int = 1) -> tuple[list[int], list[int]]:
        w: dict[int, int] = {cap: 0}
        for h in hists:
            for ub, c in h.points() if h else []:
                v = cap if ub >= cap else min(cap, max(step, math.ceil(ub / step) * step))
                w[v] = w.get(v, 0) + c
        xs = sorted(w)
        return xs, [w[x] for x in xs]

    def mean(name: str, phase: str) -> float:
        n = t.count(name, phase)
        return t.sum(name, phase) / n if n else 0.0

    q_row = mean("step_max_query_tokens", "prefill")
    kv_pre, kv_dec = mean("step_max_kv_tokens", "prefill"), mean("step_max_kv_tokens", "decode")
    h = t.hist
    dims = {}
    xs, ws = points([h("step_batch_size", "prefill")], base.max_context_batch)
    dims["context_batch"] = _Dim(xs, ws, (q_row, kv_pre), t.sum("step_batch_size", "prefill"))
    xs, ws = points([h("step_max_query_tokens", "prefill")], base.max_context_len)
    dims["context_len"] = _Dim(xs, ws, (1.0, 0.0), t.sum("step_query_tokens", "prefill"))
    xs, ws = points([h("step_batch_size", "decode")], base.max_decode_batch)
    dims["decode_batch"] = _Dim(xs, ws, (1.0, kv_dec), t.sum("step_batch_size", "decode"))
    kv_hists = [h("step_max_kv_tokens", p) for p in PHASES]
    xs, ws = points(kv_hists, base.max_kv_len, block)
    dims["decode_len"] = _Dim(xs, ws, (0.0, 1.0), sum(t.sum("step_kv_tokens", p) for p in PHASES))
    return dims


def _padded(d: _Dim, buckets: tuple[int, ...] | list[int]) -> float:
    """Sum over the observations of the bucket each lands in (values above the largest bucket:
    the largest)."""
    top = len(buckets) - 1
    return float(sum(w * buckets[min(bisect.bisect_left(buckets, x), top)] for x, w in zip(d.xs, d.ws)))


def evaluate(t: Traffic, b: BucketConfig, base: BucketConfig | None = None) -> Waste:
    """The waste of serving traffic `t` with buckets `b` (caps: `base`'s, default `b`'s)."""
    dims = _dims(t, base or b)
    q = kv = 0.0
    for name, d in dims.items():
        extra = _padded(d, getattr(b, name)) - d.real
        q, kv = q + extra * d.unit[0], kv + extra * d.unit[1]
    return Waste(q, kv, len(bucket_shapes(b, _max_model_len(t, b))))


def _max_model_len(t: Traffic, b: BucketConfig) -> int:
    return min(t.limits.get("max_model_len", b.max_kv_len), b.max_kv_len)


def optimal_buckets(xs: list[int], ws: list[float], kmax: int) -> list[tuple[float, list[int]]]:
    """For k = 1 .. min(kmax, len(xs)): the least sum of w x bucket(x) over k buckets chosen among
    `xs` (ascending), the largest always included, and those buckets. Dynamic programming: the
    best cover of xs[0..b] with k buckets, the last at xs[b], is the best cover of xs[0..j] with
    k - 1 buckets plus xs[b] for the points after j, minimised over j; O(k m^2) in numpy."""
    x = np.asarray(xs, dtype=np.float64)
    cw = np.concatenate([[0.0], np.cumsum(np.asarray(ws, dtype=np.float64))])
    m = len(xs)
    best = x * cw[1:]  # one bucket at xs[b] covering xs[0..b]
    parents: list[np.ndarray] = []
    out = [(float(best[-1]), [xs[-1]])]
    # seg[j, b]: bucket xs[b] covering xs[j+1..b]
    seg = x[None, :] * (cw[None, 1:] - cw[1:, None])
    j_lt_b = np.tri(m, m, -1, dtype=bool).T  # j < b
    for _ in range(1, min(kmax, m)):
        total = np.where(j_lt_b, best[:, None] + seg, np.inf)
        arg = np.argmin(total, axis=0)
        best = total[arg, np.arange(m)]
        parents.append(arg)
        chosen, at = [xs[-1]], m - 1
        for p in reversed(parents):
            at = int(p[at])
            chosen.append(xs[at])
        out.append((float(best[-1]), chosen[::-1]))
    return out


def _num_kv(dl: list[int], max_model_len: int) -> int:
    """KV buckets bucket_shapes lists (those whose bucket below is under max_model_len)."""
    return sum(1 for i in range(len(dl)) if (dl[i - 1] if i else 0) < max_model_len)


def _num_pairs(cl: list[int], dl: list[int], max_model_len: int) -> int:
    """Prefill (query, KV) bucket pairs bucket_shapes lists for each batch size, counted in
    O(len(cl) log len(dl)) instead of listed (the planner counts thousands of candidate sets).
    Query bucket q takes chunks from q_lo (the bucket below, + 1); it pairs with every reachable
    KV bucket s >= q_lo, each s < q raised to the KV bucket of q itself (or kept when q is above
    every KV bucket)."""
    n_kv = _num_kv(dl, max_model_len)
    n = 0
    for i, q in enumerate(cl):
        q_lo = (cl[i - 1] if i else 0) + 1
        if q_lo > max_model_len:
            continue
        at_q = bisect.bisect_left(dl, q, 0, n_kv)
        below = at_q - bisect.bisect_left(dl, q_lo, 0, n_kv)  # reachable s with q_lo <= s < q
        n += n_kv - at_q
        if below:
            if q > dl[-1]:
                n += below
            elif bisect.bisect_left(dl, q) >= n_kv:  # q's own KV bucket is not among the listed
                n += 1
    return n


@dataclass(frozen=True)
class Plan:
    buckets: BucketConfig
    waste: Waste
    current: BucketConfig
    current_waste: Waste
    budget: int
    kv_weight: float


def plan(t: Traffic, current: BucketConfig, budget: int | None = None, kv_weight: float = KV_WEIGHT) -> Plan:
    """The bucket lists with the least weighted waste on `t` within `budget` compiled graphs
    (default: as many as `current` compiles), each dimension's largest bucket `current`'s."""
    if not any(t.count("step_batch_size", p) for p in PHASES):
        raise ValueError("no steps recorded in the traffic (axonserve:step_batch_size is empty)")
    if not 0 <= kv_weight < math.inf:
        raise ValueError(f"kv weight must be a non-negative number, got {kv_weight}")
    max_len = _max_model_len(t, current)
    current_waste = evaluate(t, current)
    budget = current_waste.graphs if budget is None else budget
    dims = _dims(t, current)
    opts = {}
    for name, d in dims.items():
        price = d.unit[0] + kv_weight * d.unit[1]
        opts[name] = [(c * price, bs) for c, bs in optimal_buckets(d.xs, d.ws, MAX_BUCKETS_PER_LIST)]
    cb_cost = np.array([c for c, _ in opts["context_batch"]])
    db_cost = np.array([c for c, _ in opts["decode_batch"]])
    k_db = np.arange(1, len(db_cost) + 1)
    best: tuple[float, int, int, int, int, int] | None = None  # cost, graphs, then the four counts
    for a, (c_dl, dl) in enumerate(opts["decode_len"]):
        n_kv = _num_kv(dl, max_len)
        for i, (c_cl, cl) in enumerate(opts["context_len"]):
            pairs = _num_pairs(cl, dl, max_len)
            k_cb = np.minimum(len(cb_cost), (budget - k_db * n_kv) // max(pairs, 1))
            ok = k_cb >= 1
            if not ok.any():
                continue
            cost = c_dl + c_cl + db_cost[ok] + cb_cost[k_cb[ok] - 1]
            graphs = k_db[ok] * n_kv + k_cb[ok] * pairs
            j = int(np.lexsort((graphs, np.round(cost, 6)))[0])
            cand = (round(float(cost[j]), 6), int(graphs[j]), int(k_cb[ok][j]), i, int(k_db[ok][j]), a)
            if best is None or cand[:2] < best[:2]:
                best = cand
    if best is None:
        raise ValueError(f"a budget of {budget} graphs cannot hold one bucket per dimension")
    _, _, cb, i, db, a = best
    b = BucketConfig(
        context_batch=tuple(opts["context_batch"][cb - 1][1]),
        context_len=tuple(opts["context_len"][i][1]),
        decode_batch=tuple(opts["decode_batch"][db - 1][1]),
        decode_len=tuple(opts["decode_len"][a][1]),
    )
    waste = evaluate(t, b, current)
    assert waste.graphs <= budget, (waste.graphs, budget)
    return Plan(b, waste, current, current_waste, budget, kv_weight)


def report(p: Plan, t: Traffic) -> str:
    """The before/after table `axonserve buckets plan` prints."""
    steps = {ph: t.count("step_batch_size", ph) for ph in PHASES}
    real_q = t.sum("step_query_tokens", "prefill") + t.sum("step_query_tokens", "decode")
    real_kv = t.sum("step_kv_tokens", "prefill") + t.sum("step_kv_tokens", "decode")

    def change(a: float, b: float) -> str:
        return f"{(b - a) / a * 100:+.1f}%" if a else ""

    w = p.kv_weight
    rows = [
        ("compiled graphs", p.current_waste.graphs, p.waste.graphs, f"(budget {p.budget})"),
        ("padded query tokens", p.current_waste.query_tokens, p.waste.query_tokens, None),
        ("padded KV positions", p.current_waste.kv_positions, p.waste.kv_positions, None),
        (f"weighted waste (kv x {w:.4g})", p.current_waste.weighted(w), p.waste.weighted(w), None),
    ]
    lines = [
        f"traffic: {steps['prefill']} prefill steps, {steps['decode']} decode steps; "
        f"{real_q:.0f} query tokens, {real_kv:.0f} KV positions served",
        f"{'':32}{'current':>12}{'plan':>12}  change",
    ]
    for label, a, b, note in rows:
        lines.append(f"{label:32}{a:12.0f}{b:12.0f}  {note or change(a, b)}")
    lines.append("")
    for name in DIMENSIONS:
        cur, new = getattr(p.current, name), getattr(p.buckets, name)
        lines.append(f"{name:14} {','.join(map(str, cur))}  ->  {','.join(map(str, new))}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the command


def fetch_metrics(url: str, timeout: float = 10.0) -> str:
    """The exposition at `url` (a server's base URL gets /metrics), at most MAX_TRAFFIC_BYTES."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"--from-metrics needs an http(s) URL, got {url!r}")
    if parts.path in ("", "/"):
        url = urllib.parse.urlunsplit(parts._replace(path="/metrics"))
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (scheme checked above)
            body = r.read(MAX_TRAFFIC_BYTES + 1)
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"cannot read {url}: {e}") from None
    if len(body) > MAX_TRAFFIC_BYTES:
        raise ValueError(f"{url}: more than {MAX_TRAFFIC_BYTES} bytes")
    return body.decode("utf-8", errors="replace")


def read_traffic_json(path: str) -> Traffic:
    data = read_json_file(path, MAX_TRAFFIC_BYTES, path)
    try:
        return Traffic.from_json(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def current_buckets(t: Traffic, given: dict[str, int]) -> tuple[BucketConfig, dict[str, int]]:
    """The buckets to compare against and the limits: flags given win over what the traffic says,
    which wins over `axonserve serve`'s defaults. The traffic's buckets in force are used unless a
    limit was given (then the automatic buckets of those limits)."""
    limits = {**SERVE_DEFAULTS, **t.limits, **given}
    if "max_model_len" not in limits:
        raise ValueError("the traffic does not name the engine's max_model_len: give --max-model-len")
    lists = t.buckets if t.buckets and not given else {}
    b = BucketConfig.resolve(**limits, **lists)
    return b, limits


def cmd_plan(args: argparse.Namespace) -> int:
    if args.from_metrics:
        t = Traffic.from_exposition(fetch_metrics(args.from_metrics))
    else:
        t = read_traffic_json(args.from_json)
    given = {k: getattr(args, k) for k in LIMITS if getattr(args, k) is not None}
    if any(v < 1 for v in given.values()):
        raise ValueError("engine limits must be positive")
    current, t.limits = current_buckets(t, given)
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(t.to_json(), f)
    p = plan(t, current, args.budget, args.kv_weight)
    print(report(p, t))
    if args.out:
        write_bucket_file(args.out, p.buckets)
        print(f"\nwrote {args.out}: axonserve serve --buckets {args.out}")
    log.info("buckets.planned", graphs=p.waste.graphs, budget=p.budget, **p.buckets.as_dict())
    return 0


def add_buckets_parser(sub) -> None:
    p = sub.add_parser("buckets", help="static-shape buckets: plan them from the traffic a server saw")
    bsub = p.add_subparsers(dest="buckets_cmd", required=True)
    pl = bsub.add_parser(
        "plan",
        help="propose buckets that pad the served traffic least within a compile budget",
        description="Read the shapes a server served (its /metrics, or a saved JSON), propose the four "
        "bucket lists that pad them least within a budget of compiled graphs, and print the padded work "
        "of the buckets in force against the plan's.",
    )
    src = pl.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-metrics", metavar="URL", help="a running server (its /metrics)")
    src.add_argument("--from-json", metavar="FILE", help="traffic saved by --save-json")
    pl.add_argument("--budget", type=int, default=None, help="compiled graphs at most (default: the current buckets')")
    pl.add_argument(
        "--kv-weight",
        type=float,
        default=KV_WEIGHT,
        help="price of a padded KV position in padded query tokens (default 1/256)",
    )
    pl.add_argument("--save-json", metavar="FILE", help="save the traffic read (plan again later with --from-json)")
    pl.add_argument("--out", metavar="BUCKETS_FILE", help="write the planned buckets (for serve --buckets)")
    for name in LIMITS:
        pl.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=None,
            help=f"engine limit (default: the server's, else {SERVE_DEFAULTS.get(name, 'required')})",
        )
    pl.add_argument("--log-format", default="console", choices=["console", "json"])
    pl.add_argument("--log-level", default="warning")
    pl.set_defaults(func=cmd_plan)
