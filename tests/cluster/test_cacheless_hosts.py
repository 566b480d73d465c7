"""Cacheless clients across netns hosts (issue 13): etcd on host 0, workers on hosts 1-3, a
node without a cache on host 4.  A DCP checkpoint and a shards+marker checkpoint from the
client land on the three workers (placement by inode), read back on another host, persist in
order; a worker killed mid-write fails its files only, loses nothing fsync acknowledged, and
gets no new files while it is gone."""
from __future__ import annotations

import errno
import os
import threading
import time

import pytest

from tests.cacheless_hosts import HostCluster, cache_files
from tests.cluster_hosts import Hosts, need_hosts
from tests.e2e.frameworks import UfsWatcher, assert_same_files, run_workload, tree
from tests.etcd_server import need_etcd


@pytest.fixture(autouse=True)
def _needs():
    need_hosts(fuse=True)
    need_etcd()


def until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


WORKERS = ["w1", "w2", "w3"]


def test_checkpoints_land_on_three_workers(tmp_path):
    with Hosts(5, tag="cl") as hosts:
        etcd = hosts.etcd(tmp_path / "etcd", on=[0])
        c = HostCluster(hosts, tmp_path, etcd, workers=[1, 2, 3], clients=[4], flush_delay=0.0).start()
        cl, w2 = c.clients[0], c.workers[1]
        assert c.status()["workers"] == WORKERS
        # a DCP save (2 ranks, save + load + save again + async_save) through the client,
        # watched for a .metadata in the under-storage before the shards it names
        with UfsWatcher(c.ufs_dir) as w:
            run_workload("dcp", cl.mnt / "dcp", timeout=300)
            # a second checkpoint: 6 shards open at once (6 ranks), then its marker.  Once
            # the DCP files' sessions have ended, the 6 spread 2 per worker (bounded loads),
            # whatever the inodes hash to
            until(lambda: not c.status()["placed_open"], 30, "the DCP files' write sessions ended")
            (cl.mnt / "sh").mkdir()
            shards = {f"shard-{i}": os.urandom((2 << 20) + i) for i in range(6)}
            opened = {k: open(cl.mnt / "sh" / k, "wb") for k in shards}
            assert c.status()["placed_open"] == {w: 2 for w in WORKERS}
            for k, f in opened.items():
                f.write(shards[k])
                os.fsync(f.fileno())
            for f in opened.values():
                f.close()
            (cl.mnt / "sh" / "_SUCCESS").write_bytes(b"")
            cl.flush(timeout=180)
        assert not w.found, w.found
        assert w.scans > 0
        # every worker holds files, each holder its files' cache files; the shards 2 each
        st = c.status(str(cl.mnt))
        held = {f["path"]: f["holder"] for f in st["files"]}
        assert set(held.values()) == set(WORKERS), held
        assert sorted(h for p, h in held.items() if p.startswith("sh/shard-")) == \
            sorted(WORKERS * 2), held
        for path, holder in held.items():
            ino = os.stat(cl.mnt / path).st_ino
            assert ino in cache_files(c.node(holder)), (path, holder)
        assert not cache_files(cl), "the cacheless client has cache files"
        # read-after-write on another host (w2 reads from the holders), and the under-storage
        ufs = tree(c.ufs_dir / "dcp")
        assert_same_files(tree(cl.mnt / "dcp"), ufs, "client mount vs under-storage", loose={})
        assert_same_files(tree(w2.mnt / "dcp"), ufs, "w2's mount vs under-storage", loose={})
        for k, v in shards.items():
            assert (w2.mnt / "sh" / k).read_bytes() == v
            assert (c.ufs_dir / "sh" / k).read_bytes() == v


def _open_on(c, mnt, workers: list[str], prefix: str) -> dict:
    """One file open for writing on each worker: worker -> (name, file).  Files opened
    together are spread one per worker (placement with bounded loads)."""
    opened = {f"{prefix}{i}": open(mnt / f"{prefix}{i}", "wb") for i in range(len(workers))}
    st = c.status(str(mnt))
    files = {f["holder"]: (f["path"], opened[f["path"]]) for f in st["files"]
             if f["path"] in opened}
    assert sorted(files) == sorted(workers), st["files"]
    return files


def test_worker_killed_mid_write(tmp_path):
    """The client writes one file to each worker; the worker (not the head) holding one of
    them is killed with -9 mid-write: that file's writes/close fail with EIO, the others
    are unaffected; new files go to the live workers only; after the worker restarts the
    bytes an fsync acknowledged reach the under-storage."""
    with Hosts(5, tag="ck") as hosts:
        etcd = hosts.etcd(tmp_path / "etcd", on=[0])
        c = HostCluster(hosts, tmp_path, etcd, workers=[1, 2, 3], clients=[4], flush_delay=600).start()
        cl = c.clients[0]
        head = c.head()
        victim = next(w for w in c.workers if w.root.name != head)
        files = _open_on(c, cl.mnt, WORKERS, "f")
        acked = {}
        for holder, (name, f) in files.items():
            acked[name] = os.urandom(4 << 20)
            f.write(acked[name])
            f.flush()
            os.fsync(f.fileno())
        vname, vf = files[victim.root.name]
        stop = threading.Event()
        errs: list = []

        def keep_writing() -> None:        # the victim's file is being written when it dies
            try:
                while not stop.is_set():
                    vf.write(os.urandom(1 << 20))
                    vf.flush()
            except OSError as e:
                errs.append(e)
        t = threading.Thread(target=keep_writing)
        t.start()
        until(lambda: cache_files(victim), 30, "the victim's cache file")
        victim.kill9()
        t.join(60)
        stop.set()
        assert not t.is_alive()
        if not errs:                       # the failure may show only at close
            with pytest.raises(OSError) as ei:
                vf.close()
            errs.append(ei.value)
        else:
            try:
                vf.close()
            except OSError as e:
                assert e.errno == errno.EIO
        assert errs[0].errno == errno.EIO, errs
        # the other files go on and close fine
        for holder, (name, f) in files.items():
            if holder != victim.root.name:
                f.write(b"more")
                f.close()
                acked[name] += b"more"
                assert (c.workers[0].mnt / name).read_bytes() == acked[name]
        # once its lease is gone, no new file is placed on it
        live = [w for w in WORKERS if w != victim.root.name]
        until(lambda: c.status()["workers"] == live, 30, "the dead worker gone from placement")
        for i in range(12):
            (cl.mnt / f"new{i}").write_bytes(b"n%d" % i)
        st = c.status(str(cl.mnt))
        new_holders = {f["holder"] for f in st["files"] if f["path"].startswith("new")}
        assert new_holders and victim.root.name not in new_holders, new_holders
        victim.restart()
        cl.flush(timeout=180)
        got = {p.name: p.read_bytes() for p in c.ufs_dir.iterdir() if p.is_file()}
        for name, data in acked.items():
            if name == vname:
                assert got[name][:len(data)] == data, "fsync-acknowledged bytes were lost"
            else:
                assert got[name] == data
        assert all(got[f"new{i}"] == b"n%d" % i for i in range(12))
