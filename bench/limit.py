"""scripts/bench_limit: is the measured upload rate within 10% of upload_limit?

For each under-storage (a file:// directory, a local moto S3 server) and each limit, a
node of its own (temp ACACHE_HOME, native engine) is started with that upload_limit; files
are written through the mount (they land at disk speed), then `acache flush --wait`.  The
upload rate is measured from the node's own counter of bytes sent (status
``uploaded_bytes``, sampled every 0.1 s): the slope of a straight line fitted to the samples
between 10% and 90% of the bytes, so the start-up burst and the last commit do not count.  The whole-run rate (bytes / time from the first write to the barrier's return)
is shown too.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from acache.config import parse_size

MiB = 1 << 20


def _cli(env: dict, *args: str, timeout: float = 600) -> str:
    p = subprocess.run([sys.executable, "-m", "acache.cli", *args], env=env, capture_output=True,
                       text=True, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"bench_limit: acache {' '.join(args)} failed: {p.stderr.strip()}")
    return p.stdout


def _slope(points: list[tuple[float, int]]) -> float:
    """Least-squares slope of bytes over time: the counter moves by whole pieces (a part,
    a 4 MiB chunk), so a straight line through every sample, not two end points."""
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mb = sum(b for _, b in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (b - mb) for t, b in points) / var if var else float("nan")


def run_one(root: Path, ufs: str, env_extra: dict, limit: int, seconds: float, file_mb: int) -> dict:
    home, mnt = root / "home", root / "mnt"
    mnt.mkdir(parents=True)
    env = dict(os.environ, ACACHE_HOME=str(home), ACACHE_UFS=ufs, ACACHE_FLUSH_DELAY="0",
               ACACHE_UPLOAD_LIMIT=str(limit), ACACHE_ENGINE="native", **env_extra)
    _cli(env, "mount", str(mnt))
    try:
        total = int(limit * seconds)
        nfiles = max(1, total // (file_mb * MiB))
        size = total // nfiles
        samples: list[tuple[float, int]] = []
        stop = threading.Event()

        def sample() -> None:
            from acache.node.client import Client
            while not stop.is_set():
                with Client(home / "acache.sock") as c:
                    samples.append((time.monotonic(), c.call("status")["uploaded_bytes"]))
                stop.wait(0.1)
        base = json.loads(_cli(env, "status", "--json"))["uploaded_bytes"]
        th = threading.Thread(target=sample, daemon=True)
        t0 = time.monotonic()
        th.start()
        block = os.urandom(MiB)
        for i in range(nfiles):
            with open(mnt / f"f{i}", "wb") as f:
                for _ in range(size // MiB):
                    f.write(block)
                f.write(block[:size % MiB])
        wrote = time.monotonic() - t0
        _cli(env, "flush", "--wait", "--timeout", str(max(120, seconds * 10)))
        took = time.monotonic() - t0
        stop.set()
        th.join()
        sent = [(t, b - base) for t, b in samples]
        total_sent = sent[-1][1] if sent else 0
        mid = [(t, b) for t, b in sent if 0.1 * total_sent <= b <= 0.9 * total_sent]
        steady = _slope(mid) if len(mid) >= 3 else float("nan")
        return {"limit": limit, "bytes": nfiles * size, "files": nfiles, "write_s": wrote,
                "total_s": took, "whole_rate": nfiles * size / took, "steady_rate": steady}
    finally:
        try:
            _cli(env, "down", "--no-flush", timeout=120)
        except SystemExit:
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench_limit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limits", default="20MiB/s,50MiB/s,100MiB/s",
                    help="comma-separated upload limits (default 20MiB/s,50MiB/s,100MiB/s)")
    ap.add_argument("--seconds", type=float, default=8.0, help="data per run: limit x seconds")
    ap.add_argument("--file-mb", type=int, default=32, help="size of each file (MiB)")
    ap.add_argument("--no-s3", action="store_true", help="only the file:// under-storage")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args(argv)
    try:
        limits = [int(parse_size(x.strip().removesuffix("/s"), "--limits")) for x in a.limits.split(",")]
    except Exception as e:
        ap.error(str(e))
    if os.geteuid() != 0:
        ap.error("needs root (FUSE mounts with the native engine)")
    console = Console()
    root = Path(tempfile.mkdtemp(prefix="acache-bench-limit-"))
    rows: list[tuple[str, dict]] = []
    owned = None
    try:
        stores: list[tuple[str, str, dict]] = [("file://", f"file://{root / 'ufs'}", {})]
        if not a.no_s3:
            from bench.procs import Owned
            from bench.targets import S3Server
            owned = Owned()
            (root / "s3").mkdir()
            srv = S3Server(root / "s3").start(owned)
            stores.append(("moto S3", f"s3://{srv.bucket}/limit", srv.acache_env()))
        for name, ufs, env in stores:
            for i, limit in enumerate(limits):
                sub = root / f"{name.strip(':/').replace(' ', '-')}-{i}"
                console.log(f"{name}: upload_limit {limit / MiB:.0f} MiB/s ...")
                ufs_i = f"{ufs}/{i}" if ufs.startswith("s3://") else f"{ufs}-{i}"
                rows.append((name, run_one(sub, ufs_i, env, limit, a.seconds, a.file_mb)))
    finally:
        if owned is not None:
            owned.close()
        shutil.rmtree(root, ignore_errors=True)
    t = Table(title=f"upload_limit accuracy (native engine, {a.seconds:g} s of data per run)")
    for col in ("under-storage", "limit", "data", "writes took", "steady rate", "error",
                "whole run", "within 10%"):
        t.add_column(col, justify="left" if col == "under-storage" else "right")
    ok = True
    for name, r in rows:
        err = r["steady_rate"] / r["limit"] - 1
        good = abs(err) <= 0.10
        ok &= good
        t.add_row(name, f"{r['limit'] / MiB:.0f} MiB/s", f"{r['bytes'] / MiB:.0f} MiB",
                  f"{r['write_s']:.2f} s", f"{r['steady_rate'] / MiB:.1f} MiB/s", f"{err:+.1%}",
                  f"{r['whole_rate'] / MiB:.1f} MiB/s", "yes" if good else "[red]NO[/]")
    console.print(t)
    if a.json:
        a.json.write_text(json.dumps([{"ufs": n, **r} for n, r in rows], indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
