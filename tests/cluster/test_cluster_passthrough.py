"""Kernel passthrough on every cluster node with a cache (the native engine): the kernel writes
and reads the node's cache files itself, and the head still learns each file's size and mtime
from the node's close and fsync records (fstat of the cache file), as one host does.

Each test proves passthrough was on (status, and the daemon saw no FUSE WRITE for the bytes),
then checks the contract across nodes: read-after-close on the other node, the barrier, the
under-storage's bytes, writes through a descriptor left open after a dup's close, fsync then
kill -9."""
from __future__ import annotations

import hashlib
import os
import subprocess

import pytest

from tests.cluster_local import LocalCluster
from tests.e2e.conftest import _NATIVE, _need_fuse

pytestmark = [pytest.mark.usefixtures("need_fuse"),
              pytest.mark.skipif(not _NATIVE, reason="the native engine cannot mount here")]


@pytest.fixture
def need_fuse():
    _need_fuse()


def writes_seen(node) -> int:
    return int(node.status()["fuse_requests"].get("WRITE", 0))


def test_writes_and_reads_pass_through_on_the_head_and_a_member(tmp_path, etcd1):
    with LocalCluster(tmp_path, etcd1, 2, engine="native", flush_delay=0.0) as c:
        head_id = c.wait_head()
        for n in c.nodes:
            st = n.status()
            assert st["engine"] == "native" and st["passthrough"] is True, st
        files: dict[str, bytes] = {}
        for n in c.nodes:
            other = c.nodes[1] if n is c.nodes[0] else c.nodes[0]
            role = "head" if n.root.name == head_id else "member"
            data = os.urandom((16 << 20) + 4097)
            before = writes_seen(n)
            subprocess.run(["dd", f"of={n.mnt / role}", "bs=1M", "conv=fsync", "status=none"],
                           input=data, check=True)
            # every byte went from the kernel to the cache file: no WRITE reached the daemon
            assert writes_seen(n) - before == 0, (role, writes_seen(n) - before)
            assert (n.mnt / role).stat().st_size == len(data)
            # close-to-open on the other node: its size and bytes, from this node's cache
            got = (other.mnt / role).read_bytes()
            assert len(got) == len(data) and hashlib.sha256(got).digest() == \
                hashlib.sha256(data).digest(), role
            files[role] = data
        # overwrite in place (no O_TRUNC) shorter than before, through passthrough again
        m = next(n for n in c.nodes if n.root.name != head_id)
        with open(m.mnt / "member", "r+b") as f:
            f.write(b"Z" * 1000)
            f.truncate(5000)
        files["member"] = b"Z" * 1000 + files["member"][1000:5000]
        head = c.node(head_id)
        assert (head.mnt / "member").read_bytes() == files["member"]
        m.flush()
        assert c.ufs_files() == files


def test_writes_after_a_dup_is_closed_reach_the_head(tmp_path, etcd1):
    """close(2) of a dup'd descriptor sends FLUSH (the close journals the size then); the
    owner writes on through passthrough, which the daemon never sees: its own close(2)
    journals the rest (the cache file differs from what the first close sent)."""
    with LocalCluster(tmp_path, etcd1, 2, engine="native", flush_delay=0.0) as c:
        head_id = c.wait_head()
        m = next(n for n in c.nodes if n.root.name != head_id)
        other = c.node(head_id)
        fd = os.open(m.mnt / "f", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"1" * 5000)
        os.close(os.dup(fd))                       # FLUSH: journaled at 5000 bytes
        os.write(fd, b"2" * 70000)
        os.close(fd)
        want = b"1" * 5000 + b"2" * 70000
        assert (other.mnt / "f").read_bytes() == want
        other.flush()
        assert c.ufs_files() == {"f": want}


def test_fsync_then_kill9_of_the_member_keeps_what_fsync_acknowledged(tmp_path, etcd1):
    with LocalCluster(tmp_path, etcd1, 2, engine="native", flush_delay=600) as c:
        head_id = c.wait_head()
        m = next(n for n in c.nodes if n.root.name != head_id)
        acked = os.urandom(3 << 20)
        f = open(m.mnt / "open-at-crash", "wb")
        f.write(acked)
        f.flush()
        os.fsync(f.fileno())
        assert c.node(head_id).status()["cluster"]["head"] == head_id
        m.kill9()
        try:
            f.close()
        except OSError:
            pass
        m.restart()
        c.node(head_id).flush(timeout=120)
        got = c.ufs_files()
        assert got.get("open-at-crash", b"")[:len(acked)] == acked
