"""scripts/bench_cluster: a 2-host cluster (network namespaces on a bridge: tests.cluster_hosts)
against the baseline each case would have without acache, measured in the same run.

    host 0 (10.214.0.1)   etcd, moto's S3 server, node "a": the head (started first)
    host 1 (10.214.0.2)   node "b": a plain member
    host 2 (10.214.0.3)   with ``--s3-rtt MS`` only: moto, behind a proxy that adds MS of
                          round trip (tests/delay_proxy.py; moto then is not in host 0)
    root namespace        node "e": an embedded (RocksDB) single-host node; the bench itself

Cases, each rep interleaving acache with its baseline (order rotated from rep to rep):

    read     a file written on A, read once (cold: B has no copy) through B's mount with
             8 MiB reads, vs a plain TCP copy of the same bytes over the same link (the
             ``--plain`` server of tests.net_peer in host 0: sendfile; recv_into in host 1);
             also at tc rates (``--rates``; Hosts.rate shapes host 1's link both ways); a second
             baseline also writes what it receives to a file on B's cache disk, as B's mount
             does (it keeps a local copy): what the disk costs, apart from acache
    persist  files written on B through its mount (untimed; flush_delay is an hour, so nothing
             starts early), then the barrier ``flush --wait`` asked of B (its control socket:
             no CLI start-up in the figure) is timed: close -> in S3 (the head pulls B's bytes
             over the link, then uploads); vs the minio SDK uploading the same files from
             host 1 (fput_object with acache's part size and part concurrency, files in
             parallel like acache's stagers)
    write    fio 256 KiB sequential writes with end_fsync (1 and 4 jobs, ``--write-size`` in
             all) through A's mount (the head) and B's (a member), vs the same fio on a plain
             directory of the disk the caches are on; with the native engine the kernel
             writes the cache files itself (passthrough) on both
    closes   create + write 4 KiB + close of ``--closes`` files in one directory, one process:
             through E's mount (embedded), A's (cluster, head) and B's (cluster, over the
             peer transport to the head); ``--close-jobs 1,8``: by 1 thread, then by 8 at
             once (a DCP rank's writer threads)

``--profile DIR`` records both cluster daemons with py-spy (raw format, --nonblocking --idle:
wall-clock per thread)
during each acache run of the cases.  Needs root, /dev/fuse, etcd, moto_server.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

from acache.config import parse_size
from acache.data.under.s3 import _DEFAULTS as S3_DEFAULTS

MiB = 1 << 20
CHUNK = 8 * MiB
BUCKET = "acache-bench"
S3_PORT = 9000
KEY = "bench"
GOALS = {"read": 0.9, "persist": 0.95}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="scripts/bench_cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="read,persist,closes")
    ap.add_argument("--big", default="2GiB", help="the big file of read and persist (default 2GiB)")
    ap.add_argument("--small", type=int, default=1000, help="64 KiB files of persist (default 1000)")
    ap.add_argument("--small-size", default="64KiB")
    ap.add_argument("--writers", type=int, default=1,
                    help="threads writing persist's files into B's mount (default 1: every close "
                         "returns before the next begins, so each commit waits for the one before; "
                         "more: several files in flight, but the kernel serializes creates in one "
                         "directory, so their closes seldom overlap: see --together)")
    ap.add_argument("--together", action="store_true",
                    help="persist: the writers are ranks, alternately on A and on B, writing rounds "
                         "of one file each and closing them at one moment (a DCP step's shards)")
    ap.add_argument("--s3-rtt", type=float, default=None, metavar="MS",
                    help="run moto in a host of its own, behind a proxy that adds MS of round-trip "
                         "time (tests/delay_proxy.py: this kernel has no netem), so the head's "
                         "uploads and the direct baseline's both cross a far link to S3, as to a "
                         "real region (default: moto in host 0, no delay)")
    ap.add_argument("--closes", type=int, default=2000, help="files per closes rep (default 2000)")
    ap.add_argument("--close-jobs", default="1",
                    help="threads making the closes at once, a comma list (default 1; e.g. 1,8)")
    ap.add_argument("--write-size", default="1GiB", help="bytes each write rep moves (default 1GiB)")
    ap.add_argument("--rates", default="none,2gbit",
                    help="links of the read case: none (the bare veth) and/or tc rates")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--engine", default="native", choices=["pyfuse3", "native"],
                    help="the mounts' engine (default native: what `acache mount` uses)")
    ap.add_argument("--profile", type=Path, default=None, help="py-spy raw profiles to this directory")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: /var/tmp)")
    a = ap.parse_args(argv)
    a.big = parse_size(a.big, "--big")
    a.small_size = parse_size(a.small_size, "--small-size")
    a.write_size = parse_size(a.write_size, "--write-size")
    a.cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    a.rates = [r.strip() for r in a.rates.split(",") if r.strip()]
    from acache.config import Settings
    a.part_size, a.concurrency = S3_DEFAULTS["part_size"], S3_DEFAULTS["concurrency"]
    a.upload_concurrency = Settings().upload_concurrency
    return a


# -- baselines (run inside host 1 with Hosts.run_in) ----------------------------------------
def plain_copy(addr: str, size: int, dest: str | None = None) -> float:
    """Seconds to receive ``size`` bytes from the plain sendfile server (one socket); with
    ``dest``, each chunk is also written to that new file (what a reader keeping a copy pays)."""
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) if dest else None
    try:
        return _plain_copy(addr, size, out)
    finally:
        if out is not None:
            os.close(out)
            os.unlink(dest)


def _plain_copy(addr: str, size: int, out: int | None) -> float:
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(CHUNK))
    t0 = time.perf_counter()
    s.sendall(struct.pack(">QQ", 0, size))
    got = 0
    while got < size:
        k = s.recv_into(buf, min(CHUNK, size - got))
        if not k:
            raise RuntimeError("the plain server closed early")
        if out is not None:
            os.write(out, buf[:k])
        got += k
    dt = time.perf_counter() - t0
    s.close()
    return dt


def minio_client(endpoint: str):
    from minio import Minio
    return Minio(endpoint, access_key=KEY, secret_key=KEY, secure=False, region="us-east-1")


def direct_upload(endpoint: str, files: list[str], prefix: str, part_size: int, concurrency: int,
                  parallel: int) -> float:
    """Seconds for the minio SDK to upload ``files`` (acache's part size and concurrency)."""
    c = minio_client(endpoint)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(parallel) as ex:
        list(ex.map(lambda p: c.fput_object(BUCKET, f"{prefix}/{os.path.basename(p)}", p,
                                            part_size=part_size, num_parallel_uploads=concurrency),
                    files))
    return time.perf_counter() - t0


def s3_size(endpoint: str, prefix: str) -> tuple[int, int]:
    objs = [o for o in minio_client(endpoint).list_objects(BUCKET, prefix + "/", recursive=True)
            if not o.object_name.endswith("/")]            # acache's directory markers
    return len(objs), sum(o.size for o in objs)


def s3_empty(endpoint: str, prefix: str) -> None:
    from minio.deleteobjects import DeleteObject
    c = minio_client(endpoint)
    keys = [DeleteObject(o.object_name) for o in c.list_objects(BUCKET, prefix + "/", recursive=True)]
    for err in c.remove_objects(BUCKET, keys):
        raise RuntimeError(f"deleting {err.name}: {err}")


def s3_up(endpoint: str) -> bool:
    try:
        minio_client(endpoint).make_bucket(BUCKET)
        return True
    except Exception as e:  # noqa: BLE001 - not up yet: connection refused and the like
        return "BucketAlready" in str(e)


# -- acache side ------------------------------------------------------------------------------
def read_through(path: Path, size: int) -> float:
    buf = bytearray(CHUNK)
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        got = 0
        while True:
            k = os.readv(fd, [buf])
            if not k:
                break
            got += k
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    if got != size:
        raise RuntimeError(f"read {got} bytes of {path}, expected {size}")
    return dt


def read_ahead_kib(mnt: Path) -> str:
    dev = os.stat(mnt).st_dev
    try:
        return Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").read_text().strip()
    except OSError:
        return "?"


def closes(d: Path, n: int, jobs: int = 1) -> float:
    """Closes per second: create + write 4 KiB + close of ``n`` new files in ``d``, by
    ``jobs`` threads at once (each its share of the files, one after another)."""
    d.mkdir()
    block = b"\xa5" * 4096
    flags = os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC
    names = [os.path.join(d, f"f{i:06d}") for i in range(n)]

    def write(share: list[str]) -> None:
        for p in share:
            fd = os.open(p, flags, 0o644)
            os.write(fd, block)
            os.close(fd)

    t0 = time.perf_counter()
    if jobs == 1:
        write(names)
    else:
        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(write, [names[j::jobs] for j in range(jobs)]))
    return n / (time.perf_counter() - t0)


def etcd_txn_seconds(endpoints: list[str], n: int = 500) -> float:
    """Seconds per etcd txn one after another (a put of a small key, acknowledged once the
    members' WAL fsync is done): what each acknowledged namespace change waits for at least."""
    from acache.meta.etcd import EtcdClient
    c = EtcdClient(endpoints, prefix=b"/bench-floor/")
    for i in range(20):
        c.put(b"warm%d" % i, b"x")
    t0 = time.perf_counter()
    for i in range(n):
        c.put(b"k%d" % (i % 64), b"x" * 200)
    return (time.perf_counter() - t0) / n


def cpu_seconds(pids: list[int | None]) -> float:
    """User + system CPU the processes (and their reaped children) have used, in seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, TypeError):
            continue
        total += sum(int(x) for x in fields[11:15])
    return total / tick


def rm(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _head_status(node) -> dict:
    """The head's half of `status`, asked through ``node`` (its control socket)."""
    from acache.node.client import Client
    with Client(node.home / "acache.sock", timeout=30) as c:
        return c.call("status").get("cluster") or {}


def flush(node, timeout: float = 3600) -> float:
    """The barrier through the node's control socket (what `acache flush --wait` asks)."""
    from acache.node.client import Client
    t0 = time.perf_counter()
    with Client(node.home / "acache.sock", timeout=30) as c:
        c.flush(None, timeout)
    return time.perf_counter() - t0


def make_file(p: Path, size: int) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "wb") as f:
        left = size
        while left:
            k = min(left, CHUNK)
            f.write(os.urandom(k))
            left -= k
    return p


class Spy:
    """py-spy record of the cluster daemons while a block runs (raw: collapsed stacks)."""

    def __init__(self, outdir: Path | None, pids: dict[str, int]) -> None:
        self.outdir, self.pids, self.procs = outdir, pids, []

    def run(self, tag: str, fn, *args):
        if self.outdir is None:
            return fn(*args)
        self.outdir.mkdir(parents=True, exist_ok=True)
        for name, pid in self.pids.items():
            out = self.outdir / f"{tag}-{name}.txt"
            self.procs.append(subprocess.Popen(
                ["py-spy", "record", "--nonblocking", "-f", "raw", "-r", "100", "--threads", "--idle",
                 "-p", str(pid), "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.5)
        try:
            return fn(*args)
        finally:
            for p in self.procs:
                p.send_signal(2)
            for p in self.procs:
                p.wait(60)
            self.procs = []


# -- the run ------------------------------------------------------------------------------------
class Cluster:
    def __init__(self, a, root: Path, hosts, console: Console) -> None:
        from tests.acache_node import AcacheNode
        from tests.cluster_hosts import ClusterNode, write_secret
        self.a, self.root, self.hosts, self.console = a, root, hosts, console
        self.etcd = hosts.etcd(root / "etcd", on=[0])
        s3_host = 2 if a.s3_rtt is not None else 0
        self.s3_endpoint = f"{hosts.addr(s3_host)}:{S3_PORT}"
        moto = Path(sys.executable).with_name("moto_server")
        argv = [str(moto)] if moto.exists() else [sys.executable, "-m", "moto.server"]
        log = open(root / "moto.log", "ab")
        # with --s3-rtt, moto on host 2's loopback, reached through a proxy that delays each
        # direction by half the round trip (this kernel has no netem: tests/delay_proxy.py)
        moto_at = (hosts.addr(s3_host), S3_PORT) if a.s3_rtt is None else ("127.0.0.1", S3_PORT + 1)
        hosts.spawn(s3_host, [*argv, "-H", moto_at[0], "-p", str(moto_at[1])], stdout=log,
                    stderr=subprocess.STDOUT)
        if a.s3_rtt is not None:
            hosts.spawn(s3_host, [sys.executable, "-m", "tests.delay_proxy", self.s3_endpoint,
                                  f"{moto_at[0]}:{moto_at[1]}", f"{a.s3_rtt / 2:g}"],
                        stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 60
        while not hosts.run_in(1, s3_up, self.s3_endpoint):
            if time.monotonic() > deadline:
                raise SystemExit("scripts/bench_cluster: moto did not come up (see moto.log)")
            time.sleep(0.3)
        secret = write_secret(root / "secret")
        url = self.etcd.url("bench" + uuid.uuid4().hex[:8])
        s3env = {"ACACHE_S3_ENDPOINT": f"http://{self.s3_endpoint}", "ACACHE_S3_REGION": "us-east-1",
                 "ACACHE_S3_ACCESS_KEY": KEY, "ACACHE_S3_SECRET_KEY": KEY,
                 "ACACHE_S3_ADDRESSING": "path", "ACACHE_S3_PART_SIZE": str(a.part_size),
                 "ACACHE_S3_CONCURRENCY": str(a.concurrency),
                 "ACACHE_UPLOAD_CONCURRENCY": str(a.upload_concurrency)}
        self.nodes = {}
        for i, name in enumerate("ab"):
            addr = f"{hosts.addr(i)}:7470"
            self.nodes[name] = ClusterNode(
                hosts, i, root / name, f"s3://{BUCKET}/acache", flush_delay=3600, engine=a.engine,
                extra_env=s3env, config={"meta": url, "listen": addr, "advertise": addr,
                                         "secret_file": secret, "node_id": name})
        self.nodes["a"].start()
        self.wait_head("a")
        self.nodes["b"].start()
        self.embedded = AcacheNode(root / "e", engine=a.engine, ufs=f"file://{root / 'e-ufs'}",
                                   flush_delay=3600).start()
        self.pids = {n: node.pid() for n, node in self.nodes.items()}
        self.spy = Spy(a.profile, self.pids)

    def wait_head(self, want: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.nodes[want].status().get("cluster") or {}
            if st.get("head") == want:
                return
            time.sleep(0.2)
        raise SystemExit(f"scripts/bench_cluster: node {want} did not become the head")

    def close(self) -> None:
        self.embedded.stop()


def rotated(rep: int, what: list[str]) -> list[str]:
    k = rep % len(what)
    return what[k:] + what[:k]


def case_read(c: Cluster, src: Path, rows: list, log) -> None:
    a, hosts = c.a, c.hosts
    p = hosts.spawn(0, [sys.executable, "-m", "tests.net_peer", "--plain", f"{hosts.addr(0)}:0",
                        str(src.parent), src.name], stdout=subprocess.PIPE)
    line = p.stdout.readline()
    if not line.startswith("READY "):
        raise SystemExit(f"plain server: {line!r}")
    plain_addr = line.split()[1]
    A, B = c.nodes["a"], c.nodes["b"]
    try:
        for rate in a.rates:
            hosts.rate(1, None if rate == "none" else rate)
            t = {"acache": [], "plain": [], "disk": []}
            for rep in range(a.repeat):
                name = f"big-{rate}-{rep}"
                shutil.copyfile(src, A.mnt / name)          # closed on A: B reads it at once
                for what in rotated(rep, ["plain", "acache", "disk"]):
                    if what == "plain":
                        dt = hosts.run_in(1, plain_copy, plain_addr, a.big, timeout=3600)
                    elif what == "disk":
                        dt = hosts.run_in(1, plain_copy, plain_addr, a.big,
                                          str(c.root / "b" / "plain-copy"), timeout=3600)
                    else:
                        skipped = B.status().get("read_copy_skipped_bytes", 0)
                        dt = c.spy.run(f"read-{rate}-{rep}", read_through, B.mnt / name, a.big)
                        skipped = B.status().get("read_copy_skipped_bytes", 0) - skipped
                        log(f"read {rate} rep {rep + 1}: B's copy left out {skipped / MiB:.0f} MiB "
                            f"(written behind: {(a.big - skipped) / MiB:.0f} MiB); B's mount "
                            f"read-ahead {read_ahead_kib(B.mnt)} KiB")
                    t[what].append(dt)
                    log(f"read {rate} rep {rep + 1}: {what:6} {a.big / MiB / dt:8.0f} MiB/s")
                (A.mnt / name).unlink()
            link = "veth" if rate == "none" else f"veth, tc {rate}"
            case = f"remote read-after-write, {a.big // MiB} MiB, {link}"
            rows.append(row(case, "MiB/s", a.big / MiB, {"acache": t["acache"], "plain": t["plain"]},
                            "plain TCP copy", GOALS["read"]))
            rows.append(row("  (same, vs a copy that also writes B's disk)", "MiB/s", a.big / MiB,
                            {"acache": t["acache"], "disk": t["disk"]},
                            "plain TCP copy + write to a file on B's cache disk", None))
    finally:
        hosts.rate(1, None)
        p.kill()


def write_together(files: list[Path], dirs: list[Path], ranks: int) -> None:
    """Rank k writes files k, k + ranks, ... into dirs[k % len(dirs)] (one mount per host),
    one per round, and every rank closes its file of a round at the same moment."""
    barrier = threading.Barrier(ranks)

    def rank(k: int) -> None:
        for r in range(-(-len(files) // ranks)):
            i = r * ranks + k
            if i >= len(files):
                barrier.wait(60)             # a short last round: the others still meet
                continue
            with open(files[i], "rb") as src, open(dirs[k % len(dirs)] / files[i].name, "wb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
                barrier.wait(60)             # then every rank closes its file at once
    with ThreadPoolExecutor(ranks) as ex:
        list(ex.map(rank, range(ranks)))


def case_persist(c: Cluster, srcs: dict[str, list[Path]], rows: list, log) -> None:
    a, hosts = c.a, c.hosts
    B = c.nodes["b"]
    for label, files in srcs.items():
        total = sum(f.stat().st_size for f in files)
        t = {"acache": [], "direct": []}
        for rep in range(a.repeat):
            for what in rotated(rep, ["direct", "acache"]):
                prefix = f"{label}-{rep}"
                if what == "direct":
                    dt = hosts.run_in(1, direct_upload, c.s3_endpoint, [str(f) for f in files],
                                      f"direct/{prefix}", a.part_size, a.concurrency,
                                      a.upload_concurrency, timeout=3600)
                    want = (len(files), total)
                    got = hosts.run_in(1, s3_size, c.s3_endpoint, f"direct/{prefix}")
                    hosts.run_in(1, s3_empty, c.s3_endpoint, f"direct/{prefix}")
                else:
                    d = B.mnt / prefix
                    d.mkdir()
                    if a.together:
                        write_together(files, [c.nodes["a"].mnt / prefix, d], max(1, a.writers))
                    else:
                        with ThreadPoolExecutor(max(1, a.writers)) as ex:
                            list(ex.map(lambda f: shutil.copyfile(f, d / f.name), files))
                    os.sync()
                    dt = c.spy.run(f"persist-{prefix}", flush, B)
                    if a.together:       # how many closes the head numbered by their notice
                        log(f"persist {label} rep {rep + 1}: began_used "
                            f"{_head_status(B).get('began_used')}")
                    want = (len(files), total)
                    got = hosts.run_in(1, s3_size, c.s3_endpoint, f"acache/{prefix}")
                    shutil.rmtree(d)
                    flush(B)                                   # the deletes, untimed
                if got != want:
                    raise SystemExit(f"{what} {prefix}: {got} (objects, bytes) in S3, expected {want}")
                t[what].append(dt)
                log(f"persist {label} rep {rep + 1}: {what:6} {total / MiB / dt:8.1f} MiB/s ({dt:.2f} s)")
        desc = (f"persist {len(files):,} x {files[0].stat().st_size // 1024} KiB" if len(files) > 1
                else f"persist 1 x {total // MiB} MiB")
        by = (f"{a.writers} ranks on A and B closing together" if a.together
              else f"{a.writers} writers on B" if a.writers > 1 else "written on B")
        rows.append(row(f"{desc} {by}, close -> flush --wait", "MiB/s", total / MiB, t,
                        "direct minio upload from B", GOALS["persist"]))


def case_write(c: Cluster, base: Path, rows: list, log) -> None:
    """fio sequential writes through the head's and the member's mounts vs the raw disk."""
    from bench.fio import run_fio
    from bench.procs import drop_caches
    a = c.a
    # the embedded engine on one host, in the same run: what the cluster's figures should match
    targets = {"raw disk": base / "raw-write", "embedded, one host": c.embedded.mnt,
               "cluster head (A)": c.nodes["a"].mnt, "cluster member (B)": c.nodes["b"].mnt}
    owner = {"embedded, one host": c.embedded, "cluster head (A)": c.nodes["a"],
             "cluster member (B)": c.nodes["b"]}
    others = [p.pid for p in c.hosts._procs] + [n.pid() for n in owner.values()]   # etcd, moto, daemons
    drop_caches()
    for jobs in (1, 4):
        t: dict[str, list[float]] = {k: [] for k in targets}
        p99: dict[str, list[float]] = {k: [] for k in targets}
        for rep in range(a.repeat):
            for what in rotated(rep, list(targets)):
                d = targets[what] / f"fio-{jobs}-{rep}"
                d.mkdir(parents=True)
                cpu0 = cpu_seconds(others)
                r = run_fio(d, "write", a.write_size, jobs)
                cpu = cpu_seconds(others) - cpu0
                t[what].append(r["bytes"] / MiB / r["mib_s"])      # seconds: medians like the rest
                p99[what].append(r["p99_ms"])
                log(f"write {jobs} job(s) rep {rep + 1}: {what:20} {r['mib_s']:8.0f} MiB/s, "
                    f"p99 {r['p99_ms']:.3f} ms; CPU of etcd, moto and the daemons meanwhile "
                    f"{cpu:.2f} s of {r['wall_s']:.2f} s")
                # settle before the next run, as scripts/bench does: the persister's upload of
                # this run, the deletes and the dirty pages must not land inside the next
                # target's timing (without this the reps spread 274-1,916 MiB/s)
                if what != "raw disk":
                    flush(owner[what])
                shutil.rmtree(d)
                if what != "raw disk":
                    flush(owner[what])
                drop_caches()
        for what in ("embedded, one host", "cluster head (A)", "cluster member (B)"):
            rows.append(row(f"fio write 256 KiB, end_fsync, {jobs} job(s), {what}; p99 "
                            f"{statistics.median(p99[what]):.3f} ms vs "
                            f"{statistics.median(p99['raw disk']):.3f} ms raw", "MiB/s",
                            a.write_size / MiB, {"acache": t[what], "base": t["raw disk"]},
                            "raw disk", 0.95))


def case_closes(c: Cluster, rows: list, log) -> None:
    a = c.a
    mounts = {"embedded": c.embedded, "cluster head (A)": c.nodes["a"], "cluster member (B)": c.nodes["b"]}
    t_embedded1: list[float] = []
    for jobs in (int(j) for j in str(a.close_jobs).split(",")):
        t: dict[str, list[float]] = {k: [] for k in mounts}
        by = "" if jobs == 1 else f", {jobs} threads"
        for rep in range(a.repeat):
            for what in rotated(rep, list(mounts)):
                d = mounts[what].mnt / f"closes-{jobs}-{rep}"
                rate = c.spy.run(f"closes{jobs}-{what.split()[-1].strip('()')}-{rep}", closes, d,
                                 a.closes, jobs) if what != "embedded" else closes(d, a.closes, jobs)
                t[what].append(1 / rate)                  # seconds per close: medians like the rest
                log(f"closes rep {rep + 1}{by}: {what:20} {rate:8.0f} /s")
                shutil.rmtree(d)
        if jobs == 1 or not t_embedded1:
            t_embedded1 = t["embedded"]
        for what in ("cluster head (A)", "cluster member (B)"):
            rows.append(row(f"closes/s (create + 4 KiB + close{by}), {what}", "closes/s", 1.0,
                            {"acache": t[what], "base": t["embedded"]},
                            f"embedded (RocksDB), one host{by}", 0.5))
    # the floor of a cluster's closes: a file's create and its close are each acknowledged once
    # their etcd txn landed, one after the other for one writer (its RELEASE shares the next
    # create's txn); an upper bound 1 / (2 txns), measured from the head's host in this run
    txn = [c.hosts.run_in(0, etcd_txn_seconds, c.etcd.endpoints) for _ in range(a.repeat)]
    log(f"etcd txn one after another: {statistics.median(txn) * 1000:.2f} ms")
    rows.append(row("closes/s: etcd's floor, 2 txns per file one after another", "closes/s", 1.0,
                    {"acache": [2 * x for x in txn], "base": t_embedded1},
                    "embedded (RocksDB), one host", None))


def row(case: str, unit: str, amount: float, t: dict[str, list[float]], base_name: str,
        goal: float | None) -> dict:
    """Medians of amount/seconds, and the median of the per-rep ratios (base time / acache time)."""
    (base_key,) = [k for k in t if k != "acache"]
    ratios = [b / x for b, x in zip(t[base_key], t["acache"])]
    return {"case": case, "unit": unit, "acache": amount / statistics.median(t["acache"]),
            "base": amount / statistics.median(t[base_key]), "base_name": base_name,
            "ratio": statistics.median(ratios), "ratios": ratios, "goal": goal, "reps": len(ratios)}


def print_table(rows: list, a, console: Console) -> None:
    where = "moto S3 in host 0" if a.s3_rtt is None else f"moto S3 in host 2 at {a.s3_rtt:g} ms RTT"
    t = Table(title=f"acache cluster: 2 hosts (netns + veth bridge), {a.engine}, {where}, "
                    f"part {a.part_size // MiB} MiB x {a.concurrency}, {a.upload_concurrency} files "
                    f"in parallel; median of {a.repeat} ({os.cpu_count()} CPUs)")
    for col in ("case", "acache", "baseline", "ratio", "goal"):
        t.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        goal = "" if r["goal"] is None else ("ok " if r["ratio"] >= r["goal"] else "MISS ") + f"≥ {r['goal']:.2f}x"
        fmt = "{:,.0f}" if r["unit"] != "MiB/s" or r["acache"] > 100 else "{:,.1f}"
        t.add_row(r["case"], f"{fmt.format(r['acache'])} {r['unit']}",
                  f"{fmt.format(r['base'])} {r['unit']} ({r['base_name']})", f"{r['ratio']:.2f}x", goal)
    t.caption = "ratio: the median of each rep's baseline-time / acache-time (for closes: acache / embedded)"
    console.print(t)


def main(argv=None) -> int:
    a = parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("scripts/bench_cluster: needs root (network namespaces, FUSE mounts)")
    from tests.cluster_hosts import Hosts
    console = Console(stderr=True)
    log = console.log
    base = Path(tempfile.mkdtemp(prefix="acb-cl-", dir=a.workdir or "/var/tmp"))
    rows: list = []
    cluster = None
    try:
        log("writing the source files")
        src = base / "src"
        big = make_file(src / "big.bin", a.big)
        small = [make_file(src / "small" / f"s{i:05d}.bin", a.small_size) for i in range(a.small)]
        os.sync()
        with Hosts(3 if a.s3_rtt is not None else 2, tag="bc") as hosts:
            cluster = Cluster(a, base, hosts, console)
            log(f"cluster up: head a (pid {cluster.pids['a']}), member b (pid {cluster.pids['b']})")
            if "read" in a.cases:
                case_read(cluster, big, rows, log)
            if "persist" in a.cases:
                case_persist(cluster, {k: v for k, v in (("small", small), ("big", [big])) if v},
                             rows, log)
            if "write" in a.cases:
                case_write(cluster, base, rows, log)
            if "closes" in a.cases:
                case_closes(cluster, rows, log)
        print_table(rows, a, Console(width=160))
        if a.json:
            a.json.write_text(json.dumps(rows, indent=2))
        return 0
    finally:
        if cluster is not None:
            cluster.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
