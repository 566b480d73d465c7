"""Open-file sessions and request ids survive the head (acache.cluster.sessions, .requests):
real nodes on loopback (one etcd, FUSE mounts), the head killed -9 while files are open.

- one writer per file still holds after the takeover (EBUSY on another node);
- a generation a remote reader opened before the takeover stays on its holder until the
  reader closes, even after the file was overwritten: read to the end byte-identical;
- a mkdir whose reply was lost with the head (the head kills itself after the mkdir and its
  stored reply landed in etcd, before replying: a test hook) is answered, not run again;
- the sessions of a node that is gone (the killed head itself) are released by the reaper."""
from __future__ import annotations

import contextlib
import errno
import os
import time

import pytest

from tests.cluster.test_cluster_local import need_fuse, until  # noqa: F401 - a fixture
from tests.cluster_local import LocalCluster

pytestmark = pytest.mark.usefixtures("need_fuse")


def roles(c: LocalCluster) -> tuple:
    """(the head node, the other nodes) once a head is known."""
    h = c.node(c.wait_head())
    return h, [n for n in c.nodes if n is not h]


def ns_keys(c: LocalCluster, prefix: bytes) -> list[bytes]:
    from acache.meta.etcd import EtcdClient
    cl = EtcdClient.from_url(c.url)
    try:
        base = cl.prefix + b"ns/" + prefix
        return [kv.key[len(cl.prefix) + 3:] for kv in cl.range_prefix(base)]
    finally:
        cl.close()


def test_a_write_session_survives_the_head(tmp_path, etcd1):
    with LocalCluster(tmp_path, etcd1, 3, flush_delay=600) as c:
        head, (w, o) = roles(c)
        f = open(w.mnt / "f", "wb")
        try:
            f.write(b"w" * 10_000)
            f.flush()
            head.kill9()
            t0 = time.monotonic()
            with pytest.raises(OSError) as ei:       # waits for the new head, which knows
                open(o.mnt / "f", "r+b")
            assert ei.value.errno == errno.EBUSY, ei.value
            print(f"EBUSY from the new head after {time.monotonic() - t0:.1f} s")
            assert c.wait_head(not_=head.root.name) in (w.root.name, o.root.name)
            with pytest.raises(OSError) as ei:       # and again, with the new head settled
                open(o.mnt / "f", "ab")
            assert ei.value.errno == errno.EBUSY
            f.write(b"x" * 10)
        finally:
            f.close()
        with open(o.mnt / "f", "ab") as g:           # closed on w: o may write now
            g.write(b"o")
        assert (w.mnt / "f").read_bytes() == b"w" * 10_000 + b"x" * 10 + b"o"


def test_a_remote_reader_keeps_its_generation_through_the_takeover(tmp_path, etcd1):
    with LocalCluster(tmp_path, etcd1, 3, flush_delay=600) as c:
        head, (holder, reader) = roles(c)
        # bigger than what the reader fetches ahead (READAHEAD chunks of chunk_size) by far
        old = os.urandom(96 << 20)
        (holder.mnt / "f").write_bytes(old)
        with open(reader.mnt / "f", "rb") as r:
            first = r.read(1 << 20)
            head.kill9()
            # as many bytes (the reader's kernel would end a read at a smaller new size)
            new = os.urandom(len(old))
            (holder.mnt / "f").write_bytes(new)      # overwritten on the holder: a new generation
            assert (holder.mnt / "f").read_bytes() == new
            rest = r.read()
        got = first + rest
        assert len(got) == len(old) and got == old, "the reader's generation changed under it"
        assert (reader.mnt / "f").read_bytes() == new
        # the reader closed: its read-open record is gone, the old generation let go of
        until(lambda: not ns_keys(c, b"O"), 10, "the read-open records removed")


def test_a_mkdir_whose_reply_was_lost_with_the_head(tmp_path, etcd1):
    marker = tmp_path / "killed-once"
    c = LocalCluster(tmp_path, etcd1, 3, flush_delay=600)
    for n in c.nodes:                  # whichever node is the head when the mkdir comes
        n.env["ACACHE_TEST_KILL_BEFORE_REPLY"] = f"{marker}:mkdir:d"
    with c:
        head, (m, other) = roles(c)
        os.mkdir(m.mnt / "d")          # the head dies after it landed, before replying
        assert marker.exists(), "the head was not killed before its reply (the hook)"
        until(lambda: head.pid() is None, 10, "the head gone")
        assert c.wait_head(not_=head.root.name) in (m.root.name, other.root.name)
        assert os.path.isdir(m.mnt / "d") and os.listdir(m.mnt) == ["d"]
        text = "".join(n.log_tail(400) for n in (m, other))
        assert "was sent again: answered from its first run" in text, text
        with pytest.raises(FileExistsError):         # a new mkdir is a new request
            os.mkdir(other.mnt / "d")


def test_a_gone_nodes_sessions_are_released(tmp_path, etcd1):
    """The head itself has a file open for writing and reading when it is killed: the new head
    loads those sessions (the file stays EBUSY while the dead node's registration lives) and
    releases them once it expired, so the file does not stay locked forever."""
    with LocalCluster(tmp_path, etcd1, 3, flush_delay=600) as c:
        head, (a, b) = roles(c)
        (a.mnt / "r").write_bytes(b"r" * 1000)
        reading = open(head.mnt / "r", "rb")
        f = open(head.mnt / "f", "wb")
        f.write(b"h" * 1000)
        f.flush()
        assert ns_keys(c, b"W") and ns_keys(c, b"O")
        head.kill9()
        with contextlib.suppress(OSError):     # its mount is gone with it
            reading.close()
        with contextlib.suppress(OSError):
            f.close()

        def opened() -> bool:
            try:
                with open(a.mnt / "f", "ab") as g:
                    g.write(b"a")
                return True
            except OSError as e:
                assert e.errno == errno.EBUSY, e
                return False
        t0 = time.monotonic()
        until(opened, 30, "the dead head's write session released")
        print(f"the dead node's file writable on another node after {time.monotonic() - t0:.1f} s")
        new = c.node(c.wait_head(not_=head.root.name))
        assert "releasing the files it had open" in new.log_tail(400)
        until(lambda: not ns_keys(c, b"W") and not ns_keys(c, b"O"), 10, "its records removed")
