"""The namespace conformance suite: one host's VFS and a cluster member's give the same answers.

Each test drives the open-file VFS the FUSE engines call (lookup, create/write/release, rename,
unlink, readdir pages, setattr, symlinks, the barrier) and checks answers and errnos.  It runs
against:

  * ``local``: a single-host node (its namespace in RocksDB, this process), and
  * ``remote``: the member of a two-node cluster that is not the head, so every namespace
    operation goes as a request over the peer transport (loopback TCP) to the head, whose
    namespace is in a real etcd; the files' bytes stay in the member's cache.

Both persist to a POSIX under-storage; ``persisted()`` is what reached it after the barrier.
"""
from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

import pytest

from acache.config import Settings
from acache.errors import FsError
from acache.fs.types import ROOT_INO, Ctx
from acache.node.daemon import Node
from tests.acache_node import files_under
from tests.cluster_local import free_port

CTX = Ctx(uid=os.getuid(), gid=os.getgid(), pid=os.getpid(), umask=0o022)
RENAME_NOREPLACE = 1


class Side:
    """The VFS under test and what it persisted."""

    def __init__(self, vfs, node: Node, ufs: Path, others: list[Node]) -> None:
        self.vfs, self.node, self.ufs, self.others = vfs, node, ufs, others

    def write(self, parent: int, name: bytes, data: bytes, flags: int = os.O_WRONLY) -> int:
        fh, attr = self.vfs.create(parent, name, 0o644, flags, CTX)
        self.vfs.write(fh, 0, data)
        self.vfs.flush(fh)
        self.vfs.release(fh)
        return attr.ino

    def read(self, ino: int) -> bytes:
        fh = self.vfs.open(ino, os.O_RDONLY, CTX)
        try:
            out, off = b"", 0
            while True:
                piece = self.vfs.read(fh, off, 1 << 20)
                if not piece:
                    return out
                out += piece
                off += len(piece)
        finally:
            self.vfs.flush(fh)
            self.vfs.release(fh)

    def names(self, ino: int) -> list[bytes]:
        fh = self.vfs.opendir(ino, CTX)
        try:
            return sorted(n for n, _, _ in self.vfs.readdir(fh, 0) if n not in (b".", b".."))
        finally:
            self.vfs.releasedir(fh)

    def errno_of(self, fn, *args) -> int:
        try:
            fn(*args)
        except FsError as e:
            return e.errno
        except OSError as e:
            return e.errno or 0
        return 0

    def persisted(self) -> dict[str, bytes]:
        r = self.node.flush(None, 60)
        assert r.get("ok", True), r
        return files_under(self.ufs)


def _settings(home: Path, ufs: Path, **kw) -> Settings:
    home.mkdir(parents=True, exist_ok=True)
    return Settings(home=home, ufs=f"file://{ufs}", flush_delay=0.0, stall_timeout=30.0,
                    cache_size=1 << 30, chunk_size=1 << 20, **kw)


@pytest.fixture(params=["local", "remote"])
def ns(request, tmp_path, etcd_name):
    ufs = tmp_path / "ufs"
    ufs.mkdir()
    nodes: list[Node] = []
    try:
        if request.param == "local":
            nodes.append(Node(_settings(tmp_path / "n1", ufs)))
            side = Side(nodes[0].vfs, nodes[0], ufs, [])
        else:
            url = request.getfixturevalue("etcd1").url(etcd_name)
            for i in (1, 2):
                nodes.append(Node(_settings(tmp_path / f"n{i}", ufs, meta=url, node_id=f"n{i}",
                                            listen=f"127.0.0.1:{free_port()}")))
                if i == 1:       # n1 campaigns first and holds the head role
                    _wait(lambda: nodes[0].member.head is not None, "n1 to become the head")
            member = nodes[1]
            assert member.member.head is None, "the node under test must not be the head"
            side = Side(member.vfs, member, ufs, nodes[:1])
        yield side
    finally:
        for n in reversed(nodes):
            n.shutdown(flush=False)


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_create_write_close_lookup_read(ns):
    ino = ns.write(ROOT_INO, b"a.bin", b"x" * 5000)
    a = ns.vfs.lookup(ROOT_INO, b"a.bin")
    assert a.ino == ino and a.size == 5000 and stat.S_ISREG(a.mode)
    assert ns.vfs.getattr(ino).size == 5000
    assert ns.read(ino) == b"x" * 5000
    assert ns.errno_of(ns.vfs.lookup, ROOT_INO, b"missing") == errno.ENOENT
    assert ns.persisted() == {"a.bin": b"x" * 5000}


def test_mkdir_errors_and_rmdir(ns):
    d = ns.vfs.mkdir(ROOT_INO, b"d", 0o755, CTX)
    assert stat.S_ISDIR(d.mode)
    assert ns.errno_of(ns.vfs.mkdir, ROOT_INO, b"d", 0o755, CTX) == errno.EEXIST
    ns.write(d.ino, b"f", b"1")
    assert ns.errno_of(ns.vfs.rmdir, ROOT_INO, b"d") == errno.ENOTEMPTY
    assert ns.errno_of(ns.vfs.rmdir, ROOT_INO, b"nope") == errno.ENOENT
    assert ns.errno_of(ns.vfs.unlink, ROOT_INO, b"d") in (errno.EISDIR, errno.EPERM)
    ns.vfs.unlink(d.ino, b"f")
    ns.vfs.rmdir(ROOT_INO, b"d")
    assert ns.errno_of(ns.vfs.lookup, ROOT_INO, b"d") == errno.ENOENT
    assert ns.persisted() == {}


def test_rename_over_a_file_and_noreplace(ns):
    ns.write(ROOT_INO, b"new", b"NEW")
    ns.write(ROOT_INO, b"old", b"OLD")
    assert ns.errno_of(ns.vfs.rename, ROOT_INO, b"new", ROOT_INO, b"old", RENAME_NOREPLACE) \
        == errno.EEXIST
    ns.vfs.rename(ROOT_INO, b"new", ROOT_INO, b"old", 0)
    assert ns.names(ROOT_INO) == [b"old"]
    assert ns.read(ns.vfs.lookup(ROOT_INO, b"old").ino) == b"NEW"
    assert ns.errno_of(ns.vfs.rename, ROOT_INO, b"gone", ROOT_INO, b"x", 0) == errno.ENOENT
    d = ns.vfs.mkdir(ROOT_INO, b"d", 0o755, CTX)
    ns.vfs.rename(ROOT_INO, b"old", d.ino, b"moved", 0)
    assert ns.persisted() == {"d/moved": b"NEW"}


def test_overwrite_with_o_trunc_and_unlink(ns):
    ino = ns.write(ROOT_INO, b"f", b"first version, long")
    fh = ns.vfs.open(ino, os.O_WRONLY | os.O_TRUNC, CTX)
    ns.vfs.write(fh, 0, b"second")
    ns.vfs.flush(fh)
    ns.vfs.release(fh)
    assert ns.vfs.getattr(ino).size == 6 and ns.read(ino) == b"second"
    assert ns.persisted() == {"f": b"second"}
    ns.vfs.unlink(ROOT_INO, b"f")
    assert ns.errno_of(ns.vfs.unlink, ROOT_INO, b"f") == errno.ENOENT
    assert ns.persisted() == {}


def test_readdir_of_a_large_directory_comes_whole(ns, monkeypatch):
    from acache.cluster.member import _Head
    monkeypatch.setattr(_Head, "READDIR_PAGE", 100)   # 2,500 creates took 33 s over etcd
    d = ns.vfs.mkdir(ROOT_INO, b"many", 0o755, CTX)
    names = [b"e%05d" % i for i in range(250)]       # three pages of the remote reply
    for n in names:
        ns.vfs.mknod(d.ino, n, stat.S_IFREG | 0o644, 0, CTX)
    assert ns.names(d.ino) == names


def test_setattr_mode_and_times(ns):
    ino = ns.write(ROOT_INO, b"f", b"data")
    a = ns.vfs.setattr(ino, CTX, None, mode=0o600, mtime_ns=1_000_000_000_000_000_000)
    assert stat.S_IMODE(a.mode) == 0o600
    b = ns.vfs.getattr(ino)
    assert stat.S_IMODE(b.mode) == 0o600 and b.mtime_ns == 1_000_000_000_000_000_000


def test_symlinks_and_hostile_names(ns):
    ns.vfs.symlink(ROOT_INO, b"ln", b"target/../x", CTX)
    ln = ns.vfs.lookup(ROOT_INO, b"ln")
    assert stat.S_ISLNK(ln.mode) and ns.vfs.readlink(ln.ino) == b"target/../x"
    odd = b"\xff\xfe not utf-8 \n\t name"
    ino = ns.write(ROOT_INO, odd, b"odd")
    assert ns.vfs.lookup(ROOT_INO, odd).ino == ino
    assert odd in ns.names(ROOT_INO)
    assert ns.errno_of(ns.vfs.lookup, ROOT_INO, b"x" * 300) == errno.ENAMETOOLONG


def test_an_open_writer_is_waited_for_by_the_barrier(ns):
    fh, attr = ns.vfs.create(ROOT_INO, b"open", 0o644, os.O_WRONLY, CTX)
    ns.vfs.write(fh, 0, b"y" * 100)
    # a barrier with a short timeout fails while the file is open for writing
    from acache.errors import FlushError
    with pytest.raises(FlushError, match="open for writing|timed out"):
        ns.node.flush(None, 0.5)
    ns.vfs.flush(fh)
    ns.vfs.release(fh)
    assert ns.persisted() == {"open": b"y" * 100}
