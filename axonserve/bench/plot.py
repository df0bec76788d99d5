"""PNG of a benchmark: latency CDFs per run, and output tokens/s against concurrency.

matplotlib is an optional extra (`axonserve[bench]`); without it the plot is skipped.
"""

from __future__ import annotations

import numpy as np


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _cdf(ax, values_ms: list[float], label: str) -> None:
    v = np.sort(np.asarray(values_ms, dtype=float))
    if v.size:
        ax.plot(np.r_[v[0], v], np.r_[0.0, np.arange(1, v.size + 1) / v.size], label=label, drawstyle="steps-post")


def plot_runs(runs: list[dict], path: str, title: str = "") -> bool:
    """`runs` as written by `bench serve`/`bench compare` (each with `label`, `summary`,
    `requests`, `concurrency`). Returns False when matplotlib is missing."""
    if not have_matplotlib():
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for run in runs:
        reqs = [r for r in run["requests"] if r["ok"]]
        label = run["label"]
        _cdf(axes[0, 0], [r["ttft"] * 1e3 for r in reqs], label)
        _cdf(axes[0, 1], [g * 1e3 for r in reqs for g in r["itl"]], label)
        _cdf(axes[1, 0], [r["tpot"] * 1e3 for r in reqs if r["tpot"] is not None], label)
    for ax, name in zip(axes.flat[:3], ("TTFT", "ITL", "TPOT")):
        ax.set(xlabel=f"{name} (ms)", ylabel="fraction of samples", title=f"{name} CDF", xscale="log")
        ax.grid(True, which="both", alpha=0.3)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(ScalarFormatter())
        ax.tick_params(axis="x", which="minor", labelsize=6)
        if ax.lines:
            ax.legend(fontsize=7)
    ax = axes[1, 1]
    by_engine: dict[str, list[tuple[int, float]]] = {}
    for run in runs:
        if run.get("concurrency"):
            by_engine.setdefault(run.get("engine", "server"), []).append(
                (run["concurrency"], run["summary"]["output_throughput"])
            )
    for engine, pts in by_engine.items():
        pts.sort()
        ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=engine)
    ax.set(xlabel="max concurrency", ylabel="output tokens/s", title="throughput vs concurrency")
    if by_engine and max(len(p) for p in by_engine.values()) > 1:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
