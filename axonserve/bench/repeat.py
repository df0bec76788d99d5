"""`bench compare --repeat N`: interleaved rounds, and each figure as a median with its range.

This machine's speed swings up to 2x by the hour (its L3 is shared with other tenants), so one
run's ratio says little. Rounds alternate the engines' order (A B, B A, A B, ...: drift over a
round falls on both sides alike) and each round first probes the machine: read bandwidth with a
working set inside the L3 and one far outside it. Their ratio drops when neighbours evict our
cache lines; it is printed beside the figures it explains.
"""

from __future__ import annotations

import glob
import statistics
from collections import defaultdict
from typing import Any

# (figure, summary key, percentile or None, better when higher): what each round's table compares
FIGURES = (
    ("out tok/s", "output_throughput", None, True),
    ("TTFT p50 ms", "ttft_ms", "p50", False),
    ("ITL p50 ms", "itl_ms", "p50", False),
)


def l3_bytes() -> int:
    """The last-level cache size from sysfs (32 MiB when it cannot be read)."""
    best = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):  # (beside them: a `uevent` file)
        try:
            with open(path) as f:
                s = f.read().strip()
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1:], 1)
            best = max(best, int(s.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return best or 32 * 2**20


def machine_probe(repeats: int = 5) -> dict[str, Any]:
    """Read bandwidth (best of `repeats`, GB/s) with a working set of a quarter of the L3 and
    of 4x it (at least 64 MiB): `l3_ratio` = inside / outside; it falls as other tenants take the cache."""
    from axonserve.bench.bandwidth import read_bandwidth
    from axonserve.bench.sysload import loadavg

    l3 = l3_bytes()
    inside = read_bandwidth(max(1, l3 // 4 // 2**20), repeats)["best_gbps"]
    outside = read_bandwidth(max(64, 4 * l3 // 2**20), repeats)["best_gbps"]
    return {
        "l3_mib": l3 // 2**20,
        "in_l3_gbps": round(inside, 1),
        "dram_gbps": round(outside, 1),
        "l3_ratio": round(inside / outside, 2),
        "loadavg": loadavg(),
    }


def round_order(names: list[str], r: int) -> list[str]:
    """Round r's engine order: as given on even rounds, reversed on odd ones."""
    return list(names) if r % 2 == 0 else list(reversed(names))


def _value(summary: dict, key: str, sub: str | None) -> float | None:
    v = summary.get(key)
    if sub is not None:
        v = (v or {}).get(sub)
    return None if v is None else float(v)


def med_range(xs: list[float]) -> tuple[float, float, float] | None:
    return (statistics.median(xs), min(xs), max(xs)) if xs else None


def aggregate(rounds: list[list[dict]], base: str = "axonserve") -> list[dict]:
    """One row per (engine, concurrency): each figure's and each ratio's median [min, max] over the
    rounds. A ratio is computed within a round (axonserve's figure over the engine's, both from the
    same round), then summarised: the interleaving is what makes the pair comparable."""
    vals: dict[tuple[str, Any], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for engines in rounds:
        ours = {r["concurrency"]: r["summary"] for e in engines if e["engine"] == base for r in e["runs"]}
        for e in engines:
            for r in e["runs"]:
                row = vals[(e["engine"], r["concurrency"])]
                b = ours.get(r["concurrency"])
                for label, key, sub, _ in FIGURES:
                    v = _value(r["summary"], key, sub)
                    if v is None:
                        continue
                    row[label].append(v)
                    bv = _value(b, key, sub) if b else None
                    if bv and v:
                        row["axon÷ " + label].append(bv / v)
    out = []
    for (engine, conc), row in vals.items():
        out.append(
            {"engine": engine, "concurrency": conc, "n": len(row.get("out tok/s", []))}
            | {k: med_range(v) for k, v in row.items()}
        )
    return sorted(out, key=lambda d: (d["engine"] != base, d["engine"], d["concurrency"] or 0))


def _fmt(t: tuple[float, float, float] | None, nd: int) -> str:
    return "-" if t is None else f"{t[0]:.{nd}f} [{t[1]:.{nd}f}, {t[2]:.{nd}f}]"


def repeat_table(rows: list[dict], probes: list[dict]) -> str:
    """Markdown: medians [min, max] over the rounds; `axon÷` as in the one-run table (tok/s > 1
    and TTFT/ITL < 1 mean axonserve is ahead), then the machine probe of every round."""
    cols = [label for label, *_ in FIGURES]
    head = "| engine | conc | rounds | " + " | ".join(f"{c} | axon÷ {c.split(' ')[0]}" for c in cols) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = []
        for c in cols:
            nd = 1 if "tok/s" in c else 0
            cells += [_fmt(r.get(c), nd), _fmt(r.get("axon÷ " + c), 2)]
        lines.append(f"| {r['engine']} | {r['concurrency']} | {r['n']} | " + " | ".join(cells) + " |")
    if probes:
        lines += ["", "| round | load1 | in-L3 GB/s | DRAM GB/s | L3 ratio |", "|---|---|---|---|---|"]
        for i, p in enumerate(probes):
            la = (p.get("loadavg") or [None])[0]
            lines.append(
                f"| {i + 1} | {'-' if la is None else f'{la:.2f}'} | {p['in_l3_gbps']} | {p['dram_gbps']} "
                f"| {p['l3_ratio']} |"
            )
    return "\n".join(lines)
