"""Cacheless clients on loopback (issue 13): three workers and a node without a cache
(placement = "hash").  Its files land on the workers by rendezvous hashing of the inode with
bounded loads, read back from anywhere, persist in order; a worker killed mid-write fails its
files only."""
from __future__ import annotations

import errno
import os
import subprocess
import threading

import pytest

from tests.cluster_local import LocalCluster
from tests.e2e.conftest import _need_fuse

pytestmark = pytest.mark.usefixtures("need_fuse")


@pytest.fixture
def need_fuse():
    _need_fuse()


def cache_files(node) -> dict[int, int]:
    """ino -> size of the cache files in a node's cache directory (``<ino hex>.<gen>``)."""
    import re
    out = {}
    for p in (node.home / "cache" / "data").iterdir():
        m = re.fullmatch(r"([0-9a-f]+)\.(\d+)", p.name)
        if m and p.is_file():
            out[int(m.group(1), 16)] = p.stat().st_size
    return out


def test_cacheless_client_places_on_workers_and_reads_back(tmp_path, etcd1):
    with LocalCluster(tmp_path, etcd1, 4, flush_delay=600, cacheless=1) as c:
        w1, w2, w3, cl = c.nodes
        (cl.mnt / "ckpt").mkdir()
        shards = {f"ckpt/shard-{i:02d}": os.urandom((1 << 20) + 4099 * i) for i in range(24)}
        for k, v in shards.items():
            with open(cl.mnt / k, "wb") as f:
                f.write(v)
                f.flush()
                os.fsync(f.fileno())
        (cl.mnt / "ckpt" / ".metadata").write_bytes(b"marker")
        # nothing in the client's own cache directory; every worker holds some
        assert not cache_files(cl)
        st = cl.status(str(cl.mnt / "ckpt"))["cluster"]
        assert sorted(st["workers"]) == ["n1", "n2", "n3"]
        holders = {f["path"]: f["holder"] for f in st["files"]}
        assert set(holders.values()) == {"n1", "n2", "n3"}, holders
        for f in st["files"]:        # the holder has the bytes
            ino = os.stat(cl.mnt / f["path"]).st_ino
            assert ino in cache_files(c.node(f["holder"]))
        # read-after-write: from a worker and from the client itself
        for k, v in shards.items():
            assert (w2.mnt / k).read_bytes() == v
            assert (cl.mnt / k).read_bytes() == v
        # a rename never moves data
        os.rename(cl.mnt / "ckpt", cl.mnt / "step-1")
        st2 = cl.status(str(cl.mnt / "step-1"))["cluster"]
        assert {f["path"].removeprefix("step-1/"): f["holder"] for f in st2["files"]} == \
            {p.removeprefix("ckpt/"): h for p, h in holders.items()}
        cl.flush(timeout=120)
        got = c.ufs_files()
        assert got == {**{k.replace("ckpt/", "step-1/"): v for k, v in shards.items()},
                       "step-1/.metadata": b"marker"}
        # persisted: reads still work (from the holder or the under-storage)
        assert (cl.mnt / "step-1" / "shard-03").read_bytes() == shards["ckpt/shard-03"]


def test_overwrite_append_truncate_from_cacheless(tmp_path, etcd1):
    with LocalCluster(tmp_path, etcd1, 3, cacheless=1) as c:
        w1, w2, cl = c.nodes
        (cl.mnt / "f").write_bytes(b"A" * 100_000)
        with open(cl.mnt / "f", "ab") as f:
            f.write(b"B" * 10)
        assert (w1.mnt / "f").read_bytes() == b"A" * 100_000 + b"B" * 10
        with open(cl.mnt / "f", "r+b") as f:
            f.seek(5)
            f.write(b"xyz")
            f.seek(4)
            assert f.read(5) == b"Axyza"[:1] + b"xyz" + b"A"
        want = b"AAAAAxyz" + b"A" * (100_000 - 8) + b"B" * 10
        assert (w2.mnt / "f").read_bytes() == want
        os.truncate(cl.mnt / "f", 7)
        assert (w1.mnt / "f").read_bytes() == b"AAAAAxy"
        assert os.stat(cl.mnt / "f").st_size == 7
        # overlapping rewrites in one session land in the order written
        with open(cl.mnt / "g", "wb") as f:
            for i in range(200):
                f.seek(0)
                f.write(bytes([i % 256]) * 70_000)
        assert (w1.mnt / "g").read_bytes() == bytes([199]) * 70_000
        cl.flush()
        assert c.ufs_files() == {"f": b"AAAAAxy", "g": bytes([199]) * 70_000}


def test_file_open_on_a_cacheless_client_reads_on_its_worker_and_the_other(tmp_path, etcd1):
    # a cacheless client has g open for writing (its RELEASE may also simply be late):
    # both workers read what it fsynced -- the one holding g from its own cache (it answered
    # EIO "no copy is reachable": it looked for a peer to read from), the other from it
    with LocalCluster(tmp_path, etcd1, 3, cacheless=1) as c:
        w1, w2, cl = c.nodes
        with open(cl.mnt / "g", "wb") as f:
            f.write(b"G" * 70_000)
            f.flush()
            os.fsync(f.fileno())
            for w in (w1, w2):
                assert (w.mnt / "g").read_bytes() == b"G" * 70_000, w
        assert (w1.mnt / "g").read_bytes() == b"G" * 70_000


def test_persist_order_marker_after_shards(tmp_path, etcd1):
    """Shards then marker, every round, from the cacheless client (shards on 2 workers): the
    under-storage never shows a marker before its shards."""
    with LocalCluster(tmp_path, etcd1, 3, flush_delay=0.0, cacheless=1) as c:
        cl = c.nodes[-1]
        bad: list[str] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                names = set(os.listdir(c.ufs_dir))
                for n in names:
                    if n.startswith("marker-"):
                        i = n[7:]
                        if not all(f"shard-{i}-{j}" in names for j in range(3)):
                            bad.append(n)
        t = threading.Thread(target=watch)
        t.start()
        try:
            for i in range(25):
                for j in range(3):
                    (cl.mnt / f"shard-{i}-{j}").write_bytes(os.urandom(3000 + j))
                (cl.mnt / f"marker-{i}").write_bytes(b"done")
        finally:
            cl.flush()
            stop.set()
            t.join()
        assert not bad, f"markers before their shards: {bad[:5]}"
        assert len(c.ufs_files()) == 25 * 4


def test_worker_killed_mid_write(tmp_path, etcd1):
    """The worker holding file X is killed while X is open for writing on the cacheless
    client: X's writes/close fail with EIO; a file on another worker is unaffected; X's
    fsynced bytes are published when the worker restarts -- also when the writing process
    forked while X was open (the child's copies of the descriptors close at its exec, and
    each such close(2) is a FLUSH: it journaled X's size at the fork, and without telling
    the head that X was written on, that PUT of nothing landed as X)."""
    with LocalCluster(tmp_path, etcd1, 3, flush_delay=600, cacheless=1) as c:
        w1, w2, cl = c.nodes
        head = c.wait_head()
        victim = w2 if head == "n1" else w1
        other = w1 if victim is w2 else w2
        # two files open together go to the two workers (bounded loads: one each)
        opened = {f"f{i}": open(cl.mnt / f"f{i}", "wb") for i in range(2)}
        st = cl.status(str(cl.mnt))["cluster"]
        files = {f["holder"]: (f["path"], opened[f["path"]]) for f in st["files"]}
        assert sorted(files) == ["n1", "n2"], st["files"]
        assert st["placed_open"] == {"n1": 1, "n2": 1}, st
        subprocess.run(["true"], check=True)     # a fork + exec while both are open
        vname, vf = files[victim.root.name]
        oname, of = files[other.root.name]
        acked = os.urandom(3 << 20)
        vf.write(acked)
        vf.flush()
        os.fsync(vf.fileno())
        of.write(b"o" * 100_000)
        victim.kill9()
        with pytest.raises(OSError) as ei:
            for _ in range(64):           # the failure shows at a write or at close
                vf.write(os.urandom(1 << 20))
                vf.flush()
            vf.close()
        assert ei.value.errno == errno.EIO
        try:
            vf.close()
        except OSError:
            pass
        of.write(b"p" * 1000)
        of.close()                       # unaffected
        assert (other.mnt / oname).read_bytes() == b"o" * 100_000 + b"p" * 1000
        victim.restart()
        cl.flush(timeout=120)
        got = c.ufs_files()
        assert got[oname] == b"o" * 100_000 + b"p" * 1000
        assert got[vname][:len(acked)] == acked
