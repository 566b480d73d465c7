"""A cluster across hosts (tests/cluster_hosts.py: each host a network namespace on one bridge,
its own acache node, cache, state and mount; etcd members inside hosts; the under-storage a
shared directory, as NFS would be; every peer connection authenticated by ``secret_file``):
DCP ranks on two hosts loaded on a third before anything persisted, an HF Trainer resumed on
another host, a 1 GiB remote read, kill -9 of a holder, kill -9 of the etcd raft leader, a cut
link during a remote read, a node with the wrong secret.

The test process itself reads and writes through the mounts (a FUSE request is answered by the
node that owns the mount, whatever namespace the caller is in); whatever needs a host's network
(torch ranks) is spawned inside it.  Times are printed (``-s``) with a ``[hosts]`` prefix.
"""
from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.cluster_hosts import ClusterNode, Hosts, need_hosts, write_secret
from tests.e2e.frameworks import UfsWatcher, tree, workload_env
from tests.etcd_server import need_etcd

PORT = 7470


@pytest.fixture(autouse=True)
def _needs():
    need_hosts(fuse=True)
    need_etcd()


def say(msg: str) -> None:
    print(f"\n[hosts] {msg}", flush=True)


def until(cond, timeout: float, what: str, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(every)


class HostCluster:
    """``Hosts(n)``, etcd members on ``etcd_on``, a node on each host in ``nodes_on`` (node id
    ``h<i>``, engine from ``engines``), started in order (the first becomes the head)."""

    def __init__(self, tmp: Path, n: int, tag: str, *, nodes_on=None, etcd_on=(0,),
                 engines=("pyfuse3", "native"), flush_delay: float = 600, extra: str = "") -> None:
        self.tmp, self.n, self.tag = Path(tmp), n, tag
        self.nodes_on = list(range(n)) if nodes_on is None else list(nodes_on)
        self.etcd_on, self.engines = list(etcd_on), engines
        self.flush_delay, self.extra = flush_delay, extra
        self.ufs_dir = self.tmp / "shared"
        self.ufs_dir.mkdir(parents=True, exist_ok=True)
        self.secret = write_secret(self.tmp / "secret")
        self.name = "c" + uuid.uuid4().hex[:8]

    def __enter__(self) -> "HostCluster":
        self.hosts = Hosts(self.n, tag=self.tag).__enter__()
        try:
            self.etcd = self.hosts.etcd(self.tmp / "etcd", on=self.etcd_on)
            self.nodes = [self.node(h, self.engines[k % len(self.engines)])
                          for k, h in enumerate(self.nodes_on)]
            for node in self.nodes:
                node.start()
        except BaseException:
            self.hosts.__exit__(None, None, None)
            raise
        return self

    def node(self, host: int, engine: str = "pyfuse3", secret: Path | None = None,
             name: str | None = None) -> ClusterNode:
        addr = f"{self.hosts.addr(host)}:{PORT}"
        return ClusterNode(self.hosts, host, self.tmp / (name or f"h{host}"),
                           f"file://{self.ufs_dir}", engine=engine, flush_delay=self.flush_delay,
                           config={"meta": self.etcd.url(self.name), "listen": addr,
                                   "advertise": addr, "secret_file": secret or self.secret,
                                   "node_id": name or f"h{host}"}, extra=self.extra)

    def __exit__(self, *exc) -> None:
        self.hosts.__exit__(*exc)

    def ufs_files(self) -> dict[str, bytes]:
        return tree(self.ufs_dir)[0]

    def ufs_names(self) -> list[str]:
        return sorted(str(p.relative_to(self.ufs_dir)) for p in self.ufs_dir.rglob("*")
                      if p.is_file())


def cluster_status(node: ClusterNode) -> dict:
    return node.status()["cluster"]


def alive_map(node: ClusterNode) -> dict[str, bool]:
    return {n["id"]: n["alive"] for n in cluster_status(node)["nodes"]}


# -- 1. DCP: two ranks on two hosts, loaded on a third before it persisted --------------------------
def test_dcp_two_hosts_load_on_third_then_persist_in_order(tmp_path):
    """Ranks 0 and 1 of a gloo group (over the veth addresses) each inside its own host, writing
    into that host's mount (pyfuse3 on host 0, native on host 1); flush_delay 600, so nothing
    persists.  Host 2 (pyfuse3) loads both checkpoints whole while the under-storage is still
    empty, and its bytes of every file equal the writers'.  Then flush --wait on host 2: every
    file lands, and a watcher of the under-storage never saw a .metadata before its shards."""
    t0 = time.monotonic()
    with HostCluster(tmp_path, 3, "dcp", engines=("pyfuse3", "native", "pyfuse3")) as c:
        a, b, r = c.nodes
        (a.mnt / "dcp").mkdir()
        master = f"{c.hosts.addr(0)}:29511"
        env = dict(workload_env(), GLOO_SOCKET_IFNAME="eth0")
        ranks = [c.hosts.spawn(i, [sys.executable, "-m", "tests.cluster.hosts_workloads",
                                   "dcp_save", str(n.mnt / "dcp"), "--rank", str(i),
                                   "--master", master],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for i, n in enumerate((a, b))]
        outs = []
        for i, p in enumerate(ranks):
            out, _ = p.communicate(timeout=120)
            outs.append(out)
            assert p.returncode == 0, f"rank {i} failed:\n{out[-3000:]}"
        t_save = time.monotonic()
        assert c.ufs_names() == [], f"persisted with flush_delay 600: {c.ufs_names()}"
        load = c.hosts.run(2, [sys.executable, "-m", "tests.cluster.hosts_workloads", "dcp_load",
                               str(r.mnt / "dcp")], env=env, timeout=120, check=False)
        assert load.returncode == 0, f"load on host 2 failed:\n{load.stdout}\n{load.stderr}"
        t_load = time.monotonic()
        # every file, read on each host: the same bytes (the third host's from the holders)
        seen = [tree(n.mnt / "dcp")[0] for n in (a, b, r)]
        assert seen[0] == seen[1] == seen[2]
        names = sorted(seen[0])
        assert {os.path.basename(x) for x in names} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
        assert len(names) == 6, names
        assert c.ufs_names() == [], f"something persisted before the flush: {c.ufs_names()}"
        with UfsWatcher(c.ufs_dir, interval=0.002) as w:
            r.flush(timeout=120)
        assert not w.found, f"a .metadata landed before its shards: {w.found}"
        assert w.scans > 0
        assert c.ufs_files() == {f"dcp/{k}": v for k, v in seen[0].items()}
        say(f"dcp: save {t_save - t0:.1f}s (incl. cluster start), load on host 2 "
            f"{t_load - t_save:.1f}s, flush {time.monotonic() - t_load:.1f}s, "
            f"{w.scans} under-storage scans")


# -- 2. HF Trainer: save/rotate on one host, resume on another -----------------------------------------
def test_hf_trainer_save_on_one_host_resume_on_another(tmp_path):
    """HF Trainer (save every 2 steps, keep 2) trains 6 steps on host 0 (native engine), nothing
    persisted; host 1 (pyfuse3) sees checkpoint-6 as the last one, resumes from it to step 8
    (reading host 0's files over the transport) and rotates checkpoint-4, written on host 0,
    away; flush: the under-storage equals the namespace seen from both hosts."""
    with HostCluster(tmp_path, 2, "hf", engines=("native", "pyfuse3")) as c:
        a, b = c.nodes
        (a.mnt / "hf").mkdir()
        env = workload_env()
        t = time.monotonic()
        for host, node, kind in ((0, a, "hf_save"), (1, b, "hf_resume")):
            res = c.hosts.run(host, [sys.executable, "-m", "tests.cluster.hosts_workloads", kind,
                                     str(node.mnt / "hf")], env=env, timeout=180, check=False)
            assert res.returncode == 0, f"{kind} on host {host}:\n{res.stdout}\n{res.stderr[-3000:]}"
            say(f"hf: {kind} on host {host}: {time.monotonic() - t:.1f}s")
            t = time.monotonic()
        assert c.ufs_names() == []
        until(lambda: tree(a.mnt / "hf") == tree(b.mnt / "hf"), 5, "both hosts show one tree")
        want = tree(a.mnt / "hf")[0]
        assert sorted({k.split("/")[1] for k in want if k.startswith("out/checkpoint-")}) == \
            ["checkpoint-6", "checkpoint-8"]
        b.flush(timeout=120)
        assert c.ufs_files() == {f"hf/{k}": v for k, v in want.items()}
        say(f"hf: flush {time.monotonic() - t:.1f}s")


# -- 3. one large file: written on A, read on B cold then warm -------------------------------------
GIB = 1 << 30


def test_1gib_written_on_a_sha256_on_b_cold_then_warm(tmp_path):
    """1 GiB written through host 0's mount (native: kernel passthrough writes), sha256 read
    through host 1's (pyfuse3): cold (from host 0's cache over TCP) then warm (host 1's own
    copy); both equal the writer's."""
    with HostCluster(tmp_path, 2, "big", engines=("native", "pyfuse3")) as c:
        a, b = c.nodes
        block = os.urandom(16 << 20)
        h = hashlib.sha256()
        t = time.monotonic()
        with open(a.mnt / "big.bin", "wb") as f:
            for i in range(GIB // len(block)):
                chunk = i.to_bytes(8, "little") + block[8:]   # no two blocks alike
                h.update(chunk)
                f.write(chunk)
        t_write = time.monotonic() - t

        def sha(path: Path) -> tuple[str, float]:
            t = time.monotonic()
            hh = hashlib.sha256()
            buf = bytearray(8 << 20)
            with open(path, "rb", buffering=0) as f:
                while (n := f.readinto(buf)):
                    hh.update(memoryview(buf)[:n])
            return hh.hexdigest(), time.monotonic() - t
        cold, t_cold = sha(b.mnt / "big.bin")
        assert cold == h.hexdigest(), "cold remote read differs from what was written"
        warm, t_warm = sha(b.mnt / "big.bin")
        assert warm == h.hexdigest(), "warm read differs from what was written"
        assert c.ufs_names() == []
        say(f"1 GiB: write on A {t_write:.1f}s ({GIB / t_write / 1e6:.0f} MB/s), cold read on B "
            f"{t_cold:.1f}s ({GIB / t_cold / 1e6:.0f} MB/s), warm {t_warm:.1f}s "
            f"({GIB / t_warm / 1e6:.0f} MB/s)")


# -- 4. kill -9 of a node holding dirty data ------------------------------------------------------
def test_kill9_of_a_holder_others_report_it_keep_writing_restart_lands(tmp_path):
    """Host 1's node (native engine, not the head) holds unpersisted files and is killed -9:
    the head and host 2 report it down (status --json: cluster.nodes), keep writing, reads of
    its files fail with EIO in a bounded time, flush --wait times out (non-zero); restarted, it
    replays, and everything lands byte-identical with flush --wait returning 0."""
    with HostCluster(tmp_path, 3, "k9", engines=("pyfuse3", "native", "pyfuse3")) as c:
        head, victim, other = c.nodes
        assert cluster_status(other)["head"] == "h0"
        (victim.mnt / "v").mkdir()
        theirs = {f"v/f{i}": os.urandom(300_000 + i) for i in range(5)}
        for k, v in theirs.items():
            (victim.mnt / k).write_bytes(v)
        assert (other.mnt / "v/f0").read_bytes() == theirs["v/f0"]    # a copy on host 2 now
        victim.kill9()
        t = time.monotonic()
        for n in (head, other):
            until(lambda n=n: alive_map(n).get("h1") is False, 30, f"{n.root.name} sees h1 down")
        t_down = time.monotonic() - t
        mine = {}
        for i, n in enumerate((head, other, head, other)):       # the others keep writing
            mine[f"after{i}"] = os.urandom(100_000 + i)
            (n.mnt / f"after{i}").write_bytes(mine[f"after{i}"])
        t = time.monotonic()
        with pytest.raises(OSError) as ei:
            (other.mnt / "v/f1").read_bytes()
        t_eio = time.monotonic() - t
        assert ei.value.errno == errno.EIO, ei.value
        assert t_eio < 60, f"a read of the dead holder's file took {t_eio:.1f}s to fail"
        r = other.cli("flush", "--wait", "--timeout", "3", check=False, timeout=60)
        assert r.returncode != 0, "flush --wait returned 0 with the holder's files unpersisted"
        assert "waiting for node h1 (down)" in r.stderr, \
            f"flush --wait does not name the node: {r.stdout}{r.stderr}"
        assert set(c.ufs_files()) <= set(mine), "the dead node's files landed without it"
        t = time.monotonic()
        victim.restart()
        until(lambda: alive_map(head).get("h1") is True, 30, "h1 back")
        t_back = time.monotonic() - t
        assert other.cli("flush", "--wait", "--timeout", "120", timeout=150).returncode == 0
        assert c.ufs_files() == {**theirs, **mine}
        assert (other.mnt / "v/f1").read_bytes() == theirs["v/f1"]
        say(f"kill -9 of a holder: seen down by both others within {t_down:.1f}s; a read of its "
            f"file failed (EIO) after {t_eio:.1f}s; restart to alive {t_back:.1f}s")


# -- 5. the raft leader of three etcd members killed during a checkpoint loop -------------------------
LEADER = """
import sys
from acache.meta.etcd import EtcdClient
from tests.cluster.etcd_probe import leader
eps = sys.argv[1].split(",")
c = EtcdClient(eps)
print(leader(c, eps))
c.close()
"""


def test_etcd_leader_kill9_during_checkpoint_loop_no_error(tmp_path):
    """etcd members on hosts 0-2, nodes on hosts 0 (pyfuse3, the head) and 1 (native): a loop
    writes a checkpoint per step (a shard through each node, then a marker after both closed);
    the raft leader is killed -9 mid-loop; no step fails, the longest step is reported, every
    file lands and no marker lands before its shards."""
    with HostCluster(tmp_path, 3, "e3", nodes_on=(0, 1), etcd_on=(0, 1, 2),
                     flush_delay=0.0) as c:
        a, b = c.nodes
        leader = c.hosts.run(2, [sys.executable, "-c", LEADER, ",".join(c.etcd.endpoints)],
                             env=workload_env()).stdout.strip()
        assert leader in c.etcd.endpoints, leader
        errors: list[str] = []
        steps: list[tuple[float, float]] = []        # (start, duration) of each step
        stop = threading.Event()
        bad: list[str] = []
        want: dict[str, bytes] = {}

        def loop() -> None:
            i = 0
            while not stop.is_set() and i < 400:
                t = time.monotonic()
                try:
                    d = f"ck/step{i}"
                    (a.mnt / d).mkdir(parents=True)
                    for k, n in enumerate((a, b)):
                        data = os.urandom(256 << 10)
                        (n.mnt / d / f"shard{k}").write_bytes(data)
                        want[f"{d}/shard{k}"] = data
                    (a.mnt / d / "done").write_bytes(b"%d" % i)
                    want[f"{d}/done"] = b"%d" % i
                except OSError as e:
                    errors.append(f"step {i}: {e!r}")
                    return
                steps.append((t, time.monotonic() - t))
                i += 1

        def watch() -> None:
            while not stop.is_set():
                for m in c.ufs_dir.glob("ck/*/done"):
                    if not all((m.parent / f"shard{k}").exists() for k in (0, 1)):
                        bad.append(str(m.relative_to(c.ufs_dir)))
                time.sleep(0.005)
        th, tw = threading.Thread(target=loop), threading.Thread(target=watch)
        th.start()
        tw.start()
        try:
            until(lambda: len(steps) >= 10 or errors, 60, "10 steps before the kill")
            victim = c.etcd.member(leader)
            c.etcd.kill(victim)
            t_kill = time.monotonic()
            n_kill = len(steps)
            until(lambda: len(steps) >= n_kill + 20 or errors or not th.is_alive(), 90,
                  "20 steps after the kill")
        finally:
            stop.set()
            th.join(60)
        assert not errors, f"the writer saw errors after killing the etcd leader: {errors}"
        around = [d for s, d in steps if s + d >= t_kill - 0.1]
        before = [d for s, d in steps if s + d < t_kill]
        b.flush(timeout=120)
        tw.join(5)
        assert not bad, f"markers landed before their shards: {bad[:5]}"
        assert c.ufs_files() == want
        say(f"etcd leader {victim.name} killed: longest step after it {max(around):.2f}s "
            f"(median step before {sorted(before)[len(before) // 2]:.3f}s), "
            f"{len(steps)} steps, no error")


# -- 6. a cut link during a remote read ---------------------------------------------------------------
def test_link_cut_of_holder_during_remote_read_eio_in_bound_then_reads_again(tmp_path):
    """Host 1 (pyfuse3) holds a 64 MiB file, its link shaped to 100 mbit so a remote read takes
    seconds; host 2 (native) reads it and the holder's cable is pulled after the first MiB: the
    read fails with EIO within a bound (measured); after link_up the file reads whole again."""
    with HostCluster(tmp_path, 3, "lc", engines=("pyfuse3", "pyfuse3", "native")) as c:
        _, holder, reader = c.nodes
        data = os.urandom(64 << 20)
        (holder.mnt / "big").write_bytes(data)
        c.hosts.rate(1, "100mbit")
        started = threading.Event()
        out: dict = {}

        def read() -> None:
            got = 0
            try:
                with open(reader.mnt / "big", "rb", buffering=0) as f:
                    while (b := f.read(1 << 20)):
                        got += len(b)
                        started.set()
                out["ok"] = got
            except OSError as e:
                out["err"], out["t"], out["got"] = e, time.monotonic(), got
            finally:
                started.set()
        th = threading.Thread(target=read)
        th.start()
        assert started.wait(60), "the remote read did not start"
        c.hosts.link_down(1)
        t_cut = time.monotonic()
        th.join(300)
        assert not th.is_alive(), "the read still hangs 300 s after the cut"
        assert "err" in out, f"the read finished ({out}) although the link was cut"
        took = out["t"] - t_cut
        assert out["err"].errno == errno.EIO, out["err"]
        say(f"link cut: the remote read failed with EIO {took:.1f}s after the cut "
            f"({out['got'] >> 20} MiB read)")
        c.hosts.link_up(1)
        c.hosts.rate(1, None)
        t_up = time.monotonic()

        def whole() -> bool:
            try:
                return hashlib.sha256((reader.mnt / "big").read_bytes()).digest() == \
                    hashlib.sha256(data).digest()
            except OSError:
                return False
        until(whole, 60, "the file reads whole again after link_up", every=0.5)
        say(f"link cut: reads work again {time.monotonic() - t_up:.1f}s after link_up")
        # the stated bound (docs/cluster.md): one request timeout (10 s) plus a reconnect's (5 s);
        # later chunks and the kernel's re-reads fail at once (ClientVFS.UNREACHABLE_FOR)
        assert took < 30, f"EIO only {took:.1f}s after the cut (bound: ~15 s)"


# -- 7. a node with the wrong secret -------------------------------------------------------------------
def _connect_with(secret_path: str, address: str) -> str:
    from acache.net import auth
    from acache.net.tcp import TcpTransport
    try:
        conn = TcpTransport(auth.load_secret(secret_path)).connect(address)
        try:
            conn.request("data.read", {}, timeout=5)     # the handshake runs on first use
        finally:
            conn.close()
    except Exception as e:        # noqa: BLE001 - what the refusal looks like is the result
        return f"{type(e).__name__}: {e}"
    return "connected"


def test_node_with_wrong_secret_is_refused_cluster_keeps_serving(tmp_path):
    """A third node whose secret_file differs from the cluster's refuses to join (acache up
    fails at once, saying why, in its output and its log; it never registers, so it can never
    win the head role); a peer connection made with that secret is refused by the handshake;
    the other two nodes go on reading and writing each other's files."""
    with HostCluster(tmp_path, 3, "ws", nodes_on=(0, 1), engines=("pyfuse3", "native")) as c:
        a, b = c.nodes
        (a.mnt / "x").write_bytes(b"x" * 100_000)
        wrong = write_secret(tmp_path / "wrong")
        bad = c.node(2, "pyfuse3", secret=wrong)
        t = time.monotonic()
        with pytest.raises(AssertionError) as ei:
            bad.start()
        took = time.monotonic() - t
        assert "is not the secret" in str(ei.value), str(ei.value)[-2000:]
        assert "not joining" in bad.log_tail(200)
        assert took < 30, f"acache up with a wrong secret took {took:.1f}s to fail"
        assert bad.pid() is None, "the refused node's daemon still runs"
        assert set(alive_map(a)) == {"h0", "h1"}, "the refused node is registered"
        got = c.hosts.run_in(2, _connect_with, str(wrong), f"{c.hosts.addr(0)}:{PORT}")
        assert got.startswith("AuthError") and "secret" in got, got
        assert (b.mnt / "x").read_bytes() == b"x" * 100_000
        (b.mnt / "y").write_bytes(b"y" * 1000)
        assert (a.mnt / "y").read_bytes() == b"y" * 1000
        assert alive_map(b) == {"h0": True, "h1": True}
        say(f"wrong secret: acache up refused in {took:.1f}s; a peer connection: {got}")
