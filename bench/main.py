"""scripts/bench: the benchmark harness's command line. See scripts/bench.md."""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from acache.config import parse_size
from bench import report
from bench.procs import Owned, fuse_mounts

ALL_CASES = (1, 2, 3, 4, 5, 6, 7)
ENGINES = ("pyfuse3", "native", "native-nopt")   # native-nopt: native, passthrough = false
DEFAULT_ENGINES = ("pyfuse3", "native")


def _cases(text: str) -> list[int]:
    if text.strip() == "all":
        return list(ALL_CASES)
    try:
        out = sorted({int(x) for x in text.replace(" ", "").split(",") if x})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cases: a comma-separated list of 1-7, not {text!r}")
    if not out or not set(out) <= set(ALL_CASES):
        raise argparse.ArgumentTypeError(f"--cases: choose from 1-7 (got {text!r})")
    return out


def _engines(text: str) -> list[str]:
    out = [e for e in text.replace(" ", "").split(",") if e]
    bad = [e for e in out if e not in ENGINES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"--engines: choose from {', '.join(ENGINES)}")
    return out


def _size(text: str) -> int:
    try:
        return parse_size(text, "size")
    except Exception as e:
        raise argparse.ArgumentTypeError(str(e))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="scripts/bench",
        description="acache benchmarks, each case interleaved with its baselines in the same run. "
                    "Cases: 1 fio write, 2 read-after-write, 3 checkpoint stall (torch.save, DCP), "
                    "4 persist throughput, 5 rclone mount as a peer in cases 1 and 3, "
                    "6 metadata ops/s (create, stat, rename, utime, readdir, unlink), "
                    "7 stress-ng metadata stressors (rename, open, utime, dentry, dir).")
    ap.add_argument("--cases", type=_cases, default=list(ALL_CASES), help="e.g. 1,2,4 (default: all)")
    ap.add_argument("--size", type=_size, default=2 << 30,
                    help="state dict / persisted bytes, and fio bytes unless --fio-size (default 2GiB)")
    ap.add_argument("--fio-size", type=_size, default=None, help="bytes per fio run (all jobs together)")
    ap.add_argument("--meta-files", type=int, default=10000,
                    help="case 6: files per run, 4 KiB each, 1,000 per directory (default 10000)")
    ap.add_argument("--stress-seconds", type=float, default=10.0,
                    help="case 7: seconds per stress-ng stressor (default 10, as issue 10 ran them)")
    ap.add_argument("--stressors", default="rename,open,utime,dentry,dir",
                    help="case 7: which stress-ng stressors (default rename,open,utime,dentry,dir)")
    ap.add_argument("--repeat", type=int, default=3, help="reps per case; the table shows medians")
    ap.add_argument("--engines", type=_engines, default=list(DEFAULT_ENGINES),
                    help="pyfuse3,native (default) and/or native-nopt (native, passthrough off)")
    ap.add_argument("--json", type=Path, default=None,
                    help="where to write the results (default bench-results/bench-<time>.json)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="scratch directory on the cache filesystem (default: a new one in $TMPDIR)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--plot", type=Path, default=None, metavar="DIR",
                    help="also draw each case's table as DIR/caseN.png (needs matplotlib)")
    ap.add_argument("--no-s3", action="store_true", help="no S3 server: acache over file:// only")
    ap.add_argument("--mount-timeout", type=float, default=60.0,
                    help="seconds to wait for `acache mount` before skipping that engine")
    ap.add_argument("--op-timeout", type=float, default=None,
                    help="seconds before one save/flush is given up (default: scaled to --size)")
    a = ap.parse_args(argv)
    if a.plot is not None:
        from acache.plot import PlotError, require
        try:
            require()
        except PlotError as e:
            ap.exit(2, f"scripts/bench: {e}\n")
    if a.repeat < 1:
        ap.error("--repeat must be >= 1")
    if a.meta_files < 1:
        ap.error("--meta-files must be >= 1")
    a.stressors = [x for x in a.stressors.replace(" ", "").split(",") if x]
    from bench.stressng import STRESSORS
    if not a.stressors or not set(a.stressors) <= set(STRESSORS):
        ap.error(f"--stressors: choose from {','.join(STRESSORS)}")
    a.fio_size = a.fio_size or a.size
    a.op_timeout = a.op_timeout or max(300.0, max(a.size, a.fio_size) / (2 << 20))
    if a.json is None:
        a.json = Path("bench-results") / f"bench-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    return a


def _version(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return ""


def machine(root: Path) -> dict:
    import importlib.metadata as md
    st = os.statvfs(root)
    out = {"host": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
           "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
           "python": platform.python_version(), "fio": _version(["fio", "--version"]),
           "rclone": _version(["rclone", "version"]) if shutil.which("rclone") else "",
           "scratch_fs": _version(["findmnt", "-n", "-o", "SOURCE,FSTYPE", "--target", str(root)]),
           "scratch_free_gib": round(st.f_bavail * st.f_frsize / 2**30, 1)}
    for pkg in ("torch", "minio", "moto"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = ""
    return out


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run(a: argparse.Namespace, console: Console) -> int:
    from bench.cases import Bench
    if a.workdir:
        a.workdir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="acache-bench-", dir=a.workdir))
    owned = Owned()
    bench = Bench(a, owned, console, root)
    meta = {"started": dt.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(["scripts/bench", *sys.argv[1:]]),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
            "machine": machine(root), "engines": bench.engines}
    old = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGINT, signal.default_int_handler)   # even if started with it ignored
    complete, rc, t0 = False, 0, time.monotonic()
    try:
        console.rule(f"acache bench: cases {','.join(map(str, a.cases))}, size {a.size >> 20} MiB, "
                     f"fio {a.fio_size >> 20} MiB, {a.repeat} reps, scratch {root}")
        if 1 in a.cases or 2 in a.cases:
            bench.fio_cases()
        if 3 in a.cases:
            bench.ckpt_case()
        if 4 in a.cases:
            bench.persist_case()
        if 6 in a.cases:
            bench.meta_case()
        if 7 in a.cases:
            bench.stressng_case()
        if a.cases == [5]:
            bench.note("case 5 adds rclone to cases 1 and 3: select them too (e.g. --cases 1,3,5)")
        complete = True
    except KeyboardInterrupt:
        bench.note("interrupted: the table shows what was measured so far")
        rc = 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)     # a second Ctrl-C must not stop teardown
        console.log("tearing down: unmounting and stopping what the harness started")
        for problem in owned.close():
            bench.note(problem)
        left = [m for m in fuse_mounts() if m.startswith(str(root) + "/")]
        if left:
            bench.note(f"still mounted, scratch directory kept: {', '.join(left)}")
        elif not a.keep:
            shutil.rmtree(root, ignore_errors=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for s, h in old.items():
            signal.signal(s, h)
    meta["seconds"] = round(time.monotonic() - t0, 1)
    rows = report.build_rows(bench.ms)
    console.print()
    report.print_report(console, rows, bench.notes)
    report.write_json(a.json, meta, bench.ms, rows, bench.notes, complete)
    console.print(f"results: {a.json}")
    if a.plot is not None and rows:
        from acache.plot import bench_figures
        for path in bench_figures(a.plot, rows, report.CASES, report.label):
            console.print(f"plot: {path}")
    return rc


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    console = Console(width=max(120, Console().width), log_path=False)
    sys.exit(run(a, console))
