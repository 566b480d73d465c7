"""fio runs (cases 1 and 2) and the DCP-like small-read pattern.

Sizes: ``total`` bytes are split evenly over the jobs, so the 1-job and 4-job runs move the
same bytes. Files are named ``seq.<job>.0`` in the directory, so a read run with the same
name, job count and size reads exactly what the write run left.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

MiB = 1 << 20
BS = 256 << 10
PERCENTILES = ("50.000000", "99.000000", "99.900000")


def _per_job(total: int, jobs: int) -> int:
    return max(BS, total // jobs // BS * BS)


def run_fio(directory: Path, rw: str, total: int, jobs: int, timeout: float = 3600) -> dict:
    """One fio run; returns MiB/s, clat percentiles (ms), bytes and fio's runtime."""
    argv = ["fio", "--name=seq", f"--directory={directory}", f"--rw={rw}", f"--bs={BS}",
            f"--size={_per_job(total, jobs)}", f"--numjobs={jobs}", "--ioengine=psync",
            "--group_reporting", "--output-format=json", "--percentile_list=50:99:99.9"]
    if rw == "write":
        argv.append("--end_fsync=1")
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"fio {rw} in {directory} failed ({p.returncode}): "
                           f"{(p.stderr or p.stdout).strip()[-500:]}")
    out = p.stdout[p.stdout.index("{"):]      # fio may print notes before the JSON
    job = json.loads(out)["jobs"][0]
    side = job["read" if rw == "read" else "write"]
    pct = side.get("clat_ns", {}).get("percentile", {})
    ms = [pct.get(k, 0) / 1e6 for k in PERCENTILES]
    return {"mib_s": side["bw_bytes"] / MiB, "p50_ms": ms[0], "p99_ms": ms[1], "p999_ms": ms[2],
            "bytes": side["io_bytes"], "runtime_s": side["runtime"] / 1000, "wall_s": wall}


def fio_files(directory: Path, jobs: int) -> list[Path]:
    return [directory / f"seq.{j}.0" for j in range(jobs)]


def dcp_read(path: Path, reads: int = 2048, seed: int = 0) -> dict:
    """A DCP/torch.load-like pattern: the tail first (the zip directory / metadata, 4 KiB
    pages backwards), then many 4 KiB reads at scattered offsets. Page cache should be cold."""
    size = path.stat().st_size
    pages = max(1, size // 4096)
    rnd = random.Random(seed)
    offsets = [(pages - 1 - i) * 4096 for i in range(min(16, pages))]
    offsets += [rnd.randrange(pages) * 4096 for _ in range(reads)]
    lat = []
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        for off in offsets:
            t = time.perf_counter()
            os.lseek(fd, off, os.SEEK_SET)
            if not os.read(fd, 4096):
                raise RuntimeError(f"short read at {off} in {path}")
            lat.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0
    finally:
        os.close(fd)
    lat.sort()
    q = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))] * 1000  # noqa: E731
    return {"iops": len(offsets) / wall, "p50_ms": q(0.5), "p99_ms": q(0.99), "p999_ms": q(0.999),
            "reads": len(offsets)}
