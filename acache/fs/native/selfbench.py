"""A quick throughput sanity check of the native engine (not the benchmark harness:
that is scripts/bench).  Root only.

    python -m acache.fs.native.selfbench [--dir /var/tmp/acache-selfbench] [--size 2G]

Runs fio sequential 256 KiB writes (end_fsync, 1 and 4 jobs) and O_DIRECT sequential
reads on the raw directory and through native mounts of acache's VFS (passthrough on and
off), interleaved, and prints medians of MiB/s, p99 latency and the ratio to raw.  The
persister is not started, so uploads do not compete for the disk, and fio does not
preallocate (a reopen for writing after close makes the VFS copy the file: a VFS cost).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile

from acache.fs.native.engine import NativeEngine


def _fio(directory: str, rw: str, size_mb: int, jobs: int) -> dict:
    args = ["fio", "--name=sb", f"--directory={directory}", f"--rw={rw}", "--bs=256k",
            f"--size={size_mb // jobs}m", f"--numjobs={jobs}", "--group_reporting",
            "--ioengine=psync", "--fallocate=none", "--output-format=json"]
    args += ["--end_fsync=1"] if rw == "write" else ["--direct=1"]
    out = json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)
    side = out["jobs"][0]["write" if rw == "write" else "read"]
    pct = side["clat_ns"].get("percentile", {})
    return {"mibs": side["bw_bytes"] / (1 << 20), "p99_ms": pct.get("99.000000", 0) / 1e6}


def _vfs(cache_dir: str):
    from acache.data.cache import CacheDir
    from acache.data.persister import Persister
    from acache.data.under.mem import MemStore
    from acache.fs.vfs import VFS
    from acache.meta.kv_mem import MemKV
    from acache.meta.store import MetaStore
    meta, store = MetaStore(MemKV()), MemStore("mem://selfbench")
    cache = CacheDir(cache_dir, 1 << 40, 60)
    persister = Persister(meta, cache, store, flush_delay=3600, concurrency=1)
    vfs = VFS(meta, cache, store, persister)
    vfs.recover()
    return vfs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--size", default="2048", help="MiB per case (default 2048)")
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    size = int(a.size.rstrip("mM"))
    base = tempfile.mkdtemp(prefix="acache-selfbench-", dir=a.dir)
    rows: dict[tuple[str, str], list[dict]] = {}
    try:
        for _ in range(a.repeat):
            for target in ("raw", "passthrough", "daemon-io"):
                work = os.path.join(base, target)
                os.makedirs(work)
                eng = None
                if target != "raw":
                    mnt = os.path.join(base, "mnt")
                    os.makedirs(mnt, exist_ok=True)
                    eng = NativeEngine(_vfs(os.path.join(work, "cache")), mnt,
                                       passthrough=target == "passthrough")
                    eng.start()
                    directory = mnt
                else:
                    directory = work
                try:
                    for jobs in (1, 4):
                        d = os.path.join(directory, f"j{jobs}")
                        os.makedirs(d)
                        rows.setdefault((target, f"write x{jobs}"), []).append(
                            _fio(d, "write", size, jobs))
                        rows.setdefault((target, f"read x{jobs}"), []).append(
                            _fio(d, "read", size, jobs))
                finally:
                    if eng is not None:
                        eng.stop()
                shutil.rmtree(work)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    best = {k: sorted(v, key=lambda r: r["mibs"])[len(v) // 2] for k, v in rows.items()}
    print(f"{'target':<12} {'case':<10} {'MiB/s':>8} {'p99 ms':>8} {'x raw':>6}")
    for (target, case), r in best.items():
        raw = best[("raw", case)]["mibs"]
        print(f"{target:<12} {case:<10} {r['mibs']:8.0f} {r['p99_ms']:8.2f} "
              f"{r['mibs'] / raw:6.2f}")


if __name__ == "__main__":
    main()
