"""scripts/bench_persist: how fast acache persists to S3, against a direct upload.

In each rep, in an order rotated from rep to rep, the same bytes go to the same moto
server twice:

    direct   the minio SDK uploads the files (fput_object: multipart with acache's part
             size and part concurrency, the files in parallel like acache's stagers)
    acache   the files are copied into the mount and closed (untimed; the node's
             flush_delay is an hour, so nothing starts early), then `flush --wait` is timed:
             close -> in S3

and the table shows the medians and acache/direct.  ``--profile`` records the daemon with
py-spy during the acache runs (bench-results/persist-profile-<rep>.json, speedscope
format) to see where its time goes.

A separate module of the bench package (scripts/bench's case 4 measures the same
thing among many others); it reuses the harness's targets and process ownership.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.cluster import write_together
from bench.procs import Owned
from bench.targets import AcacheTarget, S3Server
from acache.config import parse_size
from acache.data.under.s3 import _DEFAULTS as S3_DEFAULTS

MiB = 1 << 20


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="scripts/bench_persist", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1GiB",
                    help="bytes per rep, all files together (default 1GiB)")
    ap.add_argument("--files", type=int, default=1, help="split into this many files (default 1)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--engine", default="pyfuse3", choices=["pyfuse3", "native"])
    ap.add_argument("--part-size", default=None, help="for both (default: acache's s3:// default)")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="parallel parts, for both (default: acache's s3:// default)")
    ap.add_argument("--multipart-threshold", default=None,
                    help="acache's s3:// multipart_threshold (default: its default)")
    ap.add_argument("--content-md5", default="auto", choices=["auto", "true", "false"],
                    help="acache's s3:// content_md5 (default auto, as acache: over this "
                         "http endpoint the signed SHA-256 only; true adds MD5 + ETag checks)")
    ap.add_argument("--upload-concurrency", type=int, default=None,
                    help="files in parallel, for both (default: acache's default)")
    ap.add_argument("--writers", type=int, default=1,
                    help="threads copying the files into the mount (default 1: each close "
                         "returns before the next begins, so the contract orders every commit; "
                         "more: closes overlap, as a checkpoint's ranks do, and commit in parallel)")
    ap.add_argument("--together", action="store_true",
                    help="the writers close their files at the same moment (a barrier before "
                         "each close), as a checkpoint's ranks finish their shards")
    ap.add_argument("--profile", action="store_true",
                    help="py-spy record the node during the acache runs")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="scratch directory (default: $TMPDIR)")
    a = ap.parse_args(argv)
    a.size = parse_size(a.size, "--size")
    a.part_size = parse_size(a.part_size, "--part-size") if a.part_size \
        else S3_DEFAULTS["part_size"]
    a.concurrency = a.concurrency or S3_DEFAULTS["concurrency"]
    if a.upload_concurrency is None:
        from acache.config import Settings
        a.upload_concurrency = Settings().upload_concurrency
    return a


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one by default)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_files(d: Path, size: int, n: int) -> list[Path]:
    d.mkdir(parents=True, exist_ok=True)
    out, each = [], -(-size // n)
    for i in range(n):
        p = d / f"shard-{i:03d}.bin"
        left = min(each, size - i * each)
        with open(p, "wb") as f:
            while left > 0:
                k = min(left, 8 * MiB)
                f.write(os.urandom(k))
                left -= k
        out.append(p)
    os.sync()
    return out


class Run:
    def __init__(self, a, owned: Owned, root: Path, console: Console) -> None:
        self.a, self.owned, self.root, self.console = a, owned, root, console
        self.s3 = S3Server(root / "s3")
        (root / "s3").mkdir(parents=True)
        self.s3.start(owned)
        env = dict(self.s3.acache_env(), ACACHE_FLUSH_DELAY="3600",
                   ACACHE_S3_PART_SIZE=str(a.part_size), ACACHE_S3_CONCURRENCY=str(a.concurrency),
                   ACACHE_UPLOAD_CONCURRENCY=str(a.upload_concurrency))
        env["ACACHE_S3_CONTENT_MD5"] = a.content_md5
        if a.multipart_threshold:
            env["ACACHE_S3_MULTIPART_THRESHOLD"] = a.multipart_threshold
        self.node = AcacheTarget(root / "acache", a.engine, f"s3://{self.s3.bucket}/acache", env)
        if not self.node.start(owned, 60):
            raise SystemExit(f"scripts/bench_persist: acache did not mount: {self.node.note}")
        self.pid = self.node.status()["pid"]

    def direct(self, files: list[Path]) -> tuple[float, float]:
        c = self.s3.client()
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        with ThreadPoolExecutor(self.a.upload_concurrency) as ex:
            list(ex.map(lambda p: c.fput_object(
                self.s3.bucket, f"direct/{p.name}", str(p), part_size=self.a.part_size,
                num_parallel_uploads=self.a.concurrency), files))
        dt, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
        self.s3.empty("direct/")
        return dt, cpu

    def acache(self, files: list[Path], rep: int) -> tuple[float, float]:
        d = self.node.mnt / "bench"
        d.mkdir(exist_ok=True)
        writers = max(1, self.a.writers)
        if self.a.together:     # rounds of `writers` files, closed at one moment
            write_together(files, [d], writers)
        else:
            with ThreadPoolExecutor(writers) as ex:   # closed: journaled, waits for the flush
                list(ex.map(lambda p: shutil.copyfile(p, d / p.name), files))
        os.sync()                   # checkpoint writers fsync; the direct source is synced too
        spy = None
        if self.a.profile:
            out = Path("bench-results").absolute() / f"persist-profile-{rep + 1}.json"
            out.parent.mkdir(exist_ok=True)
            spy = subprocess.Popen(["py-spy", "record", "-p", str(self.pid), "-o", str(out),
                                    "-f", "speedscope", "-r", "200", "--threads",
                                    "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        cpu0 = cpu_seconds(self.pid)
        try:
            dt = self.node.flush(1800)
            cpu = cpu_seconds(self.pid) - cpu0
        finally:
            if spy is not None:
                spy.send_signal(2)
                spy.wait(60)
                self.console.log(f"profile: {out}")
        got = self.s3.size_of("acache/bench/")
        if got != sum(p.stat().st_size for p in files):
            raise SystemExit(f"scripts/bench_persist: {got} bytes in S3 after the flush, expected "
                             f"{sum(p.stat().st_size for p in files)}")
        shutil.rmtree(d)
        self.node.flush(600)                     # the deletes, untimed
        return dt, cpu


def main(argv=None) -> int:
    a = parse_args(argv)
    console = Console(stderr=True)
    base = Path(tempfile.mkdtemp(prefix="acache-bench-persist-", dir=a.workdir))
    owned = Owned()
    try:
        files = make_files(base / "src", a.size, a.files)
        run = Run(a, owned, base / "t", console)
        total = sum(p.stat().st_size for p in files)
        times: dict[str, list[float]] = {"direct": [], "acache": []}
        cpus: dict[str, list[float]] = {"direct": [], "acache": []}
        ratios: list[float] = []
        order = ["direct", "acache"]
        for rep in range(a.repeat):
            for what in order[rep % 2:] + order[:rep % 2]:
                dt, cpu = run.direct(files) if what == "direct" else run.acache(files, rep)
                times[what].append(dt)
                cpus[what].append(cpu)
                console.log(f"rep {rep + 1}: {what:6} {total / MiB / dt:8.1f} MiB/s ({dt:.2f} s, "
                            f"{cpu:.2f} s CPU)")
            ratios.append(times["direct"][-1] / times["acache"][-1])
        med = {k: statistics.median(v) for k, v in times.items()}
        mcpu = {k: statistics.median(v) for k, v in cpus.items()}
        t = Table(title=f"persist to S3 (moto on 127.0.0.1): {total / MiB:.0f} MiB in {a.files} "
                        f"file(s), part {a.part_size // MiB} MiB x {a.concurrency}, "
                        f"{a.upload_concurrency} files in parallel, content_md5 {a.content_md5}, "
                        f"{a.engine}, {a.writers} writer(s) into the mount"
                        f"{' closing together' if a.together else ''}, median of {a.repeat}")
        for col in ("target", "MiB/s", "seconds", "CPU s/GiB", "vs direct"):
            t.add_column(col, justify="left" if col == "target" else "right")
        gib = total / (1 << 30)
        t.add_row("direct minio upload", f"{total / MiB / med['direct']:.1f}",
                  f"{med['direct']:.2f}", f"{mcpu['direct'] / gib:.2f}", "1.00x")
        t.add_row("acache close -> flush --wait", f"{total / MiB / med['acache']:.1f}",
                  f"{med['acache']:.2f}", f"{mcpu['acache'] / gib:.2f}",
                  f"{statistics.median(ratios):.2f}x")
        t.caption = ("vs direct: the median of each rep's direct/acache time ratio; CPU: the "
                     "uploading process (this one / the acache node)")
        Console().print(t)
        return 0
    finally:
        problems = owned.close()
        for p in problems:
            console.print(f"[yellow]teardown:[/] {p}")
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
