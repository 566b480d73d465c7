"""Pictures of what the demo's and the benchmark's tables say (matplotlib: the `plot` extra).

``require()`` is called before any work starts, so a missing matplotlib is one line and
an exit status, not a traceback after a long run.  Figures are drawn with the Agg backend
(files only: no display needed).
"""
from __future__ import annotations

from pathlib import Path

MiB = 1 << 20
VIA, DIRECT, RAW = "#2a9d8f", "#e9c46a", "#8d99ae"


class PlotError(Exception):
    """Why a plot cannot be drawn (one line)."""


def require():
    """matplotlib.pyplot on the Agg backend, or PlotError saying how to install it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("--plot needs matplotlib: pip install 'acache[plot]' "
                        "(or scripts/install test,torch,plot)") from None
    return plt


def demo_figure(path: Path, via: list, direct: list, samples: list, marks: list,
                label: str, title: str, flush_at: float | None = None) -> None:
    """Two panels: per save, how long the loop was blocked (through acache vs straight to the
    under-storage); and during the acache run, dirty and persisted MiB over time with the
    saves marked.  ``samples``: [(s, dirty, persisted, sent bytes)]; ``marks``: [(s, step)]."""
    plt = require()
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.3]})
    steps = [str(s[0]) for s in via]
    x = range(len(steps))
    w = 0.4
    a.bar([i - w / 2 for i in x], [s[2] for s in via], w, label="through acache", color=VIA)
    a.bar([i + w / 2 for i in x], [s[2] for s in direct], w, label=f"straight to {label}",
          color=DIRECT)
    for i, (sv, sd) in enumerate(zip(via, direct)):
        if sv[2] > 0:
            a.annotate(f"{sd[2] / sv[2]:.1f}x", (i, max(sv[2], sd[2])), ha="center",
                       va="bottom", fontsize=9, xytext=(0, 2), textcoords="offset points")
    a.set_xticks(list(x), steps)
    a.set_xlabel("save at training step")
    a.set_ylabel("training loop blocked (s)")
    a.set_title("time each save blocked the loop")
    top = max([s[2] for s in via] + [s[2] for s in direct] + [1e-3])
    a.set_ylim(0, top * 1.35)             # room above the bars for the ratios and the legend
    a.legend(loc="upper center", ncol=2, fontsize=9, frameon=False)
    a.grid(axis="y", alpha=0.3)
    if samples:
        t = [s[0] for s in samples]
        b.plot(t, [s[1] / MiB for s in samples], label="dirty (not yet persisted)", color="#e76f51",
               marker=".", ms=4)
        b.plot(t, [s[3] / MiB for s in samples], label="sent to the under-storage", color="#8ab17d",
               ls="--")
        b.plot(t, [s[2] / MiB for s in samples], label="persisted (files committed)", color=VIA,
               marker=".", ms=4)
        for i, (ts, step) in enumerate(marks):
            b.axvline(ts, color="#999", lw=0.8, ls=":", label="a save starts" if i == 0 else None)
        if flush_at is not None:
            b.axvline(flush_at, color="#264653", lw=1.2, ls="--", label="training ends: flush --wait")
        b.set_ylim(0, max([max(s[1:]) for s in samples] + [MiB]) / MiB * 1.35)
        b.legend(loc="upper left", fontsize=8, ncol=2, frameon=False)
    b.set_xlabel("seconds since the acache run started")
    b.set_ylabel("MiB")
    b.set_title("persisting in the background (acache run, then flush --wait)")
    b.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_UNITS = {"mib_s": "MiB/s", "ops_s": "operations/s", "seconds": "seconds (lower is better)",
          "iops": "IOPS"}


def _short(text: str, n: int = 34) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def bench_figures(directory: Path, rows, cases: dict, label) -> list[Path]:
    """One PNG per case: per test, a bar per target of the median primary metric, the
    baseline (raw disk) in grey, its ratio to the baseline written at the bar."""
    plt = require()
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for case in sorted({r.case for r in rows}):
        title, unit, _ = cases.get(case, (f"case {case}", None, None))
        tests = list(dict.fromkeys(r.test for r in rows if r.case == case))[:8]
        fig, axes = plt.subplots(len(tests), 1, figsize=(10, 1.2 + 0.45 * max(
            len([r for r in rows if r.case == case and r.test == t]) for t in tests) * len(tests)),
            squeeze=False)
        for ax, test in zip(axes[:, 0], tests):
            rs = [r for r in rows if r.case == case and r.test == test and r.median.get(r.primary)
                  is not None]
            names = [_short(label(r.target)) for r in rs]
            vals = [r.median[r.primary] for r in rs]
            colors = [RAW if r.target == r.baseline else VIA if r.target.startswith("acache")
                      else DIRECT for r in rs]
            ax.barh(names, vals, color=colors)
            ax.invert_yaxis()
            for i, r in enumerate(rs):
                note = (f" {vals[i]:,.0f}" if vals[i] >= 100 else f" {vals[i]:.3g}") + (f"  ({r.ratio:.2f}× {r.baseline})"
                                            if r.ratio is not None and r.target != r.baseline else "")
                ax.text(vals[i], i, note, va="center", fontsize=8)
            ax.set_title(test, fontsize=10, loc="left")
            ax.set_xlabel(_UNITS.get(rs[0].primary, rs[0].primary) if rs else "")
            ax.margins(x=0.35)
            ax.grid(axis="x", alpha=0.3)
        fig.suptitle(f"case {case}: {title}")
        fig.tight_layout()
        path = directory / f"case{case}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
