"""Measurements -> medians, ratios, rich tables and the JSON file.

A measurement is one rep of one (case, test, target). A row is the median over reps of each
metric, with the ratio of its primary metric to the baseline target's median in the same test.
For throughput (MiB/s, IOPS) ratio = this / baseline (higher is better); for stall times
ratio = this / baseline (lower is better) and ``s3_over`` = direct-to-S3 seconds / this.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

CASES = {
    1: ("fio sequential write (bs=256k, end_fsync)", "mib_s", "raw"),
    2: ("read-after-write (page cache dropped)", None, "raw"),
    3: ("checkpoint stall: time until the save call returns", "seconds", "raw"),
    4: ("persist throughput: close -> persisted", "mib_s", None),
    6: ("metadata: operations per second, files of 4 KiB, 1,000 per directory", "ops_s", "raw"),
    7: ("stress-ng metadata stressors, 1 worker: bogo-ops/s (real time)", "ops_s", "raw"),
}
LABELS = {
    "raw": "raw disk (cache fs)", "dir": "directory (file:// under-storage)",
    "s3": "S3 direct (minio SDK)", "rclone": "rclone mount (vfs-cache writes)",
    "upload": "minio upload (same server)", "cp": "cp + fsync to the directory",
    "acache-native-nopt": "acache native, no passthrough",
}


def label(target: str) -> str:
    if target in LABELS:
        return LABELS[target]
    if target.startswith("acache-"):
        return "acache " + target.split("-", 1)[1].replace("-", " → ")
    return target


@dataclass
class Measurement:
    case: int
    test: str
    target: str
    rep: int
    metrics: dict
    primary: str
    baseline: str | None = None


@dataclass
class Row:
    case: int
    test: str
    target: str
    primary: str
    median: dict
    n: int
    baseline: str | None = None
    ratio: float | None = None
    s3_over: float | None = None
    values: list = field(default_factory=list)


def build_rows(ms: list[Measurement]) -> list[Row]:
    groups: dict[tuple, list[Measurement]] = {}
    for m in ms:
        groups.setdefault((m.case, m.test, m.target), []).append(m)
    rows = []
    for (case, test, target), g in groups.items():
        keys = [k for k in g[0].metrics if all(isinstance(x.metrics.get(k), (int, float)) for x in g)]
        med = {k: statistics.median(x.metrics[k] for x in g) for k in keys}
        rows.append(Row(case, test, target, g[0].primary, med, len(g), g[0].baseline,
                        values=[x.metrics[g[0].primary] for x in g]))
    by = {(r.case, r.test, r.target): r for r in rows}
    for r in rows:
        base = by.get((r.case, r.test, r.baseline)) if r.baseline else None
        if base is not None and base is not r and base.median.get(r.primary):
            r.ratio = r.median[r.primary] / base.median[r.primary]
        s3 = by.get((r.case, r.test, "s3"))
        if r.case == 3 and s3 is not None and r.median.get("seconds"):
            r.s3_over = s3.median["seconds"] / r.median["seconds"]
    order = {t: i for i, t in enumerate(dict.fromkeys(m.test for m in ms))}
    return sorted(rows, key=lambda r: (r.case, r.test.startswith("DCP-like"), order[r.test],
                                       r.target != r.baseline, r.target))


def headline(rows: list[Row]) -> list[dict]:
    """Direct-to-S3 stall / acache stall, for every checkpoint test and engine."""
    return [{"test": r.test, "target": r.target, "s3_over_acache": r.s3_over}
            for r in rows if r.case == 3 and r.target.startswith("acache-") and r.s3_over]


def _f(x, digits=2) -> str:
    if x is None:
        return "—"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def _ratio(x) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _spread(r: Row) -> str:
    """(max - min) / median of the primary metric over the reps: how noisy the row is."""
    med = r.median.get(r.primary)
    if r.n < 2 or not med:
        return "—"
    return f"±{(max(r.values) - min(r.values)) / med * 50:.0f}%"


def tables(rows: list[Row]) -> list[Table]:
    out = []
    for case in sorted({r.case for r in rows}):
        rs = [r for r in rows if r.case == case]
        t = Table(title=f"case {case}: {CASES[case][0]}", title_justify="left")
        t.add_column("test")
        t.add_column("target")
        if case in (1, 2):
            t.add_column("MiB/s | IOPS", justify="right")
            for c in ("p50 ms", "p99 ms", "p99.9 ms"):
                t.add_column(c, justify="right")
            t.add_column("× raw", justify="right")
        elif case in (6, 7):
            t.add_column("ops/s", justify="right")
            t.add_column("× raw", justify="right")
        elif case == 3:
            t.add_column("seconds", justify="right")
            t.add_column("× raw (lower is better)", justify="right")
            t.add_column("S3 ÷ this", justify="right")
        else:
            t.add_column("MiB/s", justify="right")
            t.add_column("seconds", justify="right")
            t.add_column("× direct", justify="right")
        t.add_column("spread", justify="right")
        t.add_column("n", justify="right")
        last = None
        for r in rs:
            test = r.test if r.test != last else ""
            if last is not None and test:
                t.add_section()
            last = r.test
            m = r.median
            if case in (1, 2):
                v = f"{_f(m[r.primary])} {'IOPS' if r.primary == 'iops' else ''}".strip()
                cells = [v, _f(m.get("p50_ms"), 3), _f(m.get("p99_ms"), 3), _f(m.get("p999_ms"), 3),
                         _ratio(r.ratio)]
            elif case in (6, 7):
                cells = [_f(m["ops_s"]), _ratio(r.ratio)]
            elif case == 3:
                cells = [_f(m["seconds"], 3), _ratio(r.ratio), _ratio(r.s3_over)]
            else:
                cells = [_f(m["mib_s"]), _f(m.get("seconds"), 3), _ratio(r.ratio)]
            t.add_row(test, label(r.target), *cells, _spread(r), str(r.n))
        out.append(t)
    return out


def print_report(console: Console, rows: list[Row], notes: list[str]) -> None:
    for t in tables(rows):
        console.print(t)
    for n in notes:
        console.print(f"[yellow]note:[/] {n}", highlight=False)
    hl = headline(rows)
    if hl:
        parts = [f"{h['test']} via {label(h['target'])}: [bold]{h['s3_over_acache']:.1f}×[/]" for h in hl]
        console.print("[bold]headline — direct-to-S3 stall ÷ acache stall:[/] " + "; ".join(parts))
    elif any(r.case == 3 for r in rows):
        console.print("headline: no direct-to-S3 stall measured (S3 off or failed)")


def write_json(path: Path, meta: dict, ms: list[Measurement], rows: list[Row], notes: list[str],
               complete: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": "acache-bench/1", **meta, "complete": complete, "notes": notes,
           "rows": [asdict(r) | {"label": label(r.target)} for r in rows],
           "headline": headline(rows), "measurements": [asdict(m) for m in ms]}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)
