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
    """1 GiB written through host 0's mount (pyfuse3), sha256 read through host 1's (native):
    cold (from host 0's cache over TCP) then warm (host 1's own copy); both equal the writer's."""
    with HostCluster(tmp_path, 2, "big", engines=("pyfuse3", "native")) as c:
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
