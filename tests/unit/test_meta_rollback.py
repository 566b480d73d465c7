"""A metadata write that fails leaves memory as the KV has it (issue 9, item 1).

The VFS changes Inode/Entry objects in place before its Txn commits; when the KV refuses
the batch (a full disk), the operation must fail with EIO and be applied nowhere: not in
the KV, not in memory (no journal entry that the persister could still apply), no cache
file left behind.  Memory must equal what a fresh MetaStore reads from the same KV."""
import errno
import os

import pytest

from acache.errors import FsError, MetaError
from acache.fs.types import ROOT_INO, Ctx
from acache.meta.kv_mem import MemKV
from acache.meta.store import MetaStore
from tests.unit.test_vfs_journal import Rig

CTX = Ctx()


class FailingKV(MemKV):
    """MemKV whose writes fail (as RocksDB's on a full disk) while ``fail`` is set."""

    def __init__(self):
        super().__init__()
        self.fail = False
        self.refused = 0

    def write(self, puts, deletes=(), sync=False):
        if self.fail:
            self.refused += 1
            raise OSError(errno.ENOSPC, "No space left on device: While appending to file: 000004.log")
        super().write(puts, deletes, sync)


def memory(meta: MetaStore):
    inodes = {i: n.pack() for i, n in meta._inodes.items()}
    children = {p: dict(c) for p, c in meta._children.items() if c}
    journal = [e.pack() for e in meta._journal.values()]
    index = ({k: {op: list(es) for op, es in v.items()} for k, v in meta._of_ino.items()}, {k: set(v) for k, v in meta._moves_of.items()},
             [e.pack() for e in meta.pending_puts()], [e.pack() for e in meta.path_changes()])
    return inodes, children, journal, index


def stored(kv):
    return memory(MetaStore(kv))


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path, kv=FailingKV(), flush_delay=3600)   # nothing persists on its own
    yield r
    r.stop()


def test_failed_commits_leave_memory_equal_to_the_kv(rig):
    v, meta, kv = rig.vfs, rig.meta, rig.kv
    d = rig.mkdir(ROOT_INO, b"ck")
    a = rig.write(d, b"a", b"A" * 1000)
    b = rig.write(d, b"b", b"B" * 2000)
    e = rig.mkdir(ROOT_INO, b"empty")
    node_b = meta.get(b)
    entry_a = meta.puts_of(a)[0]
    before = memory(meta)
    assert before == stored(kv)
    files_before = rig.cache.known()

    fh_open = v.open(a, os.O_RDWR)          # open before the failures: written, closed below
    v.write(fh_open, 0, b"a" * 10)
    kv.fail = True
    attempts = [
        ("mkdir", lambda: v.mkdir(d, b"new", 0o755, CTX)),
        ("create", lambda: v.create(d, b"c", 0o644, os.O_WRONLY, CTX)),
        ("unlink", lambda: v.unlink(d, b"a")),
        ("rename", lambda: v.rename(d, b"b", ROOT_INO, b"moved", 0)),
        ("rename over", lambda: v.rename(d, b"b", d, b"a", 0)),
        ("rmdir", lambda: v.rmdir(ROOT_INO, b"empty")),
        ("chmod", lambda: v.setattr(b, CTX, mode=0o600)),
        ("truncate open", lambda: v.open(b, os.O_WRONLY | os.O_TRUNC)),
        ("close", lambda: v.flush(fh_open)),
    ]
    for what, op in attempts:
        with pytest.raises(FsError) as exc:
            op()
        assert exc.value.errno == errno.EIO, what
        assert isinstance(exc.value, MetaError), what
        kv.fail = False
        assert memory(meta) == stored(kv), f"{what}: memory differs from the KV"
        kv.fail = True
    v.release(fh_open)                      # its close could not be journaled: no raise
    refused = kv.refused
    assert refused >= len(attempts)
    kv.fail = False

    # nothing of the failed operations anywhere; objects held elsewhere are still the ones
    assert meta.get(b) is node_b and node_b.name == b"b" and node_b.parent == d
    assert meta.entry(entry_a.seq) is entry_a
    assert meta.child(d, b"new") is None and meta.child(d, b"c") is None
    assert meta.child(ROOT_INO, b"empty") == e and meta.child(ROOT_INO, b"moved") is None
    assert rig.cache.known() <= files_before | {(a, meta.get(a).gen)}
    assert memory(meta) == stored(kv)

    # the store works again; the file whose close failed is journaled when asked and lands
    assert v.journal_unjournaled() == [a]
    v.rename(d, b"b", ROOT_INO, b"moved", 0)
    rig.drain()
    files = rig.files()
    assert files["ck/a"] == b"a" * 10 + b"A" * 990
    assert files["moved"] == b"B" * 2000
    assert "ck/new" not in files and "ck/c" not in files


def test_unreadable_store_refuses_changes_until_it_reads_again(rig):
    v, meta, kv = rig.vfs, rig.meta, rig.kv
    d = rig.mkdir(ROOT_INO, b"d")
    scan = kv.scan
    kv.scan = lambda prefix: (_ for _ in ()).throw(OSError(errno.EIO, "read failed"))
    kv.fail = True
    with pytest.raises(MetaError):
        v.mkdir(d, b"x", 0o755, CTX)
    assert meta.stale
    kv.fail = False
    with pytest.raises(MetaError):          # built on memory still ahead of the KV
        v.mkdir(d, b"y", 0o755, CTX)
    kv.scan = scan
    with pytest.raises(MetaError):          # this one reads the KV back
        v.mkdir(d, b"z", 0o755, CTX)
    assert not meta.stale and memory(meta) == stored(kv)
    v.mkdir(d, b"w", 0o755, CTX)
    assert sorted(meta.children(d)) == [b"w"]


def test_an_operation_failing_before_its_commit_is_undone_in_memory(rig, monkeypatch):
    """A cache-disk error in the middle of an operation (the copy of a pending generation
    when the disk is full) leaves memory changed that no batch carried; the engines' error
    edge (VFS.after_failure) brings memory back to the KV's state."""
    v, meta, kv = rig.vfs, rig.meta, rig.kv
    a = rig.write(ROOT_INO, b"a", b"A" * 1000)
    rig.write(ROOT_INO, b"b", b"B" * 10)         # a's PUT is no longer the newest entry
    gen = meta.get(a).gen

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(rig.cache, "clone", full)
    with pytest.raises(OSError) as err:
        v.open(a, os.O_WRONLY)                   # a new generation: a copy of the pending one
    assert meta.get(a).gen != gen and memory(meta) != stored(kv)   # changed, never committed
    assert v.after_failure(err.value) is True
    assert meta.get(a).gen == gen
    assert memory(meta) == stored(kv)
    assert v.after_failure(err.value) is False   # nothing left to undo
    monkeypatch.undo()
    fh = v.open(a, os.O_WRONLY)                  # and the file works as before
    v.write(fh, 0, b"C" * 1000)
    v.flush(fh)
    v.release(fh)
    assert memory(meta) == stored(kv)


def test_a_close_that_failed_to_journal_is_journaled_by_the_next(rig):
    """A FLUSH whose journaling failed leaves the handle open: the next FLUSH of it (the
    owner's close(2), after a forked child's exec closed its copy) journals the file -- or
    fails -- itself, instead of returning 0 for bytes never journaled."""
    v, meta, kv = rig.vfs, rig.meta, rig.kv
    fh, attr = v.create(ROOT_INO, b"f", 0o644, os.O_WRONLY, CTX)
    v.write(fh, 0, b"x" * 5000)
    kv.fail = True
    with pytest.raises((FsError, MetaError)):
        v.flush(fh)                     # the child's FLUSH: the metadata write fails
    kv.fail = False
    assert not meta.puts_of(attr.ino)
    v.flush(fh)                         # the owner's close: journals it now
    puts = meta.puts_of(attr.ino)
    assert [e.size for e in puts] == [5000], puts
    v.release(fh)
    assert memory(meta) == stored(kv)
