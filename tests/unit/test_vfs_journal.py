"""The VFS + journal rules + persister over an in-memory KV and under-store (no mount)."""
import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from acache.data import barrier
from acache.data.cache import CacheDir
from acache.data.persister import Persister
from acache.data.under.mem import MemState, MemStore
from acache.errors import FlushError, FsError, PermanentError
from acache.fs.types import ROOT_INO, Ctx
from acache.fs.vfs import VFS
from acache.meta.kv_mem import MemKV
from acache.meta.kv_rocks import RocksKV
from acache.meta.store import MetaStore

CTX = Ctx()
REPO = Path(__file__).resolve().parents[2]


class Rig:
    def __init__(self, tmp, store=None, kv=None, flush_delay=0.0, clock=time.monotonic):
        self.tmp = tmp
        self.store = store or MemStore("mem://t")
        self.kv = kv or MemKV()
        self.meta = MetaStore(self.kv, clock=clock)
        self.cache = CacheDir(str(tmp / "cache"), 1 << 30, 5)
        self.p = Persister(self.meta, self.cache, self.store, flush_delay=flush_delay, concurrency=2)
        self.vfs = VFS(self.meta, self.cache, self.store, self.p, chunk_size=1 << 20)
        self.recovered = self.vfs.recover()
        self.p.start()

    def write(self, parent, name, data, fsync=False):
        fh, attr = self.vfs.create(parent, name, 0o644, os.O_WRONLY, CTX)
        self.vfs.write(fh, 0, data)
        if fsync:
            self.vfs.fsync(fh, False)
        self.vfs.flush(fh)
        self.vfs.release(fh)
        return attr.ino

    def mkdir(self, parent, name):
        return self.vfs.mkdir(parent, name, 0o755, CTX).ino

    def drain(self, timeout=10):
        self.p.hurry(self.meta.last_seq())
        deadline = time.monotonic() + timeout
        while self.meta.journal_len():
            assert time.monotonic() < deadline, f"journal not drained: {self.meta.journal()}"
            time.sleep(0.01)

    def files(self):
        with self.store.state.lock:
            return {k: v[0] for k, v in self.store.state.files.items()}

    def touched(self, path):
        return [c for c in self.store.calls if path in c[1] and c[0] != "read"]

    def stop(self):
        self.p.stop()


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.stop()


def test_close_persists_in_order(rig):
    d = rig.mkdir(ROOT_INO, b"ck")
    for i in range(5):
        rig.write(d, b"shard%d" % i, b"s" * (1000 * i + 1))
    rig.write(d, b".metadata", b"meta")
    rig.drain()
    commits = [p for op, p in rig.store.calls if op == "commit"]
    assert commits == [f"ck/shard{i}" for i in range(5)] + ["ck/.metadata"]
    assert rig.files()["ck/shard3"] == b"s" * 3001


def test_rename_of_pending_file_costs_nothing_for_old_name(tmp_path):
    r = Rig(tmp_path, flush_delay=5)     # nothing starts before the rename
    try:
        d = r.mkdir(ROOT_INO, b"ck")
        r.write(d, b".metadata.tmp", b"new")
        r.vfs.rename(d, b".metadata.tmp", d, b".metadata", 0)
        r.drain()
        assert r.touched(".metadata.tmp") == []
        assert r.files() == {"ck/.metadata": b"new"}
    finally:
        r.stop()


def test_rename_moves_commit_after_later_closes(tmp_path):
    """x.tmp closed before a shard, renamed to the marker after: the marker lands last."""
    r = Rig(tmp_path, flush_delay=5)
    try:
        r.write(ROOT_INO, b"x.tmp", b"marker")
        r.write(ROOT_INO, b"shard", b"data")
        r.vfs.rename(ROOT_INO, b"x.tmp", ROOT_INO, b"marker", 0)
        r.drain()
        commits = [p for op, p in r.store.calls if op == "commit"]
        assert commits == ["shard", "marker"]
    finally:
        r.stop()


def test_delete_cancels_pending_upload(tmp_path):
    r = Rig(tmp_path, flush_delay=5)
    try:
        r.write(ROOT_INO, b"tmpfile", b"x" * 100)
        r.vfs.unlink(ROOT_INO, b"tmpfile", CTX)
        r.drain()
        assert r.touched("tmpfile") == [] and r.files() == {}
        assert not os.listdir(r.cache.dir)
    finally:
        r.stop()


def test_delete_of_persisted_file_never_resurrects(rig):
    rig.write(ROOT_INO, b"f", b"1")
    rig.drain()
    rig.vfs.unlink(ROOT_INO, b"f", CTX)
    rig.drain()
    assert rig.files() == {}


def test_overwrite_of_pending_file_keeps_both_generations_apart(tmp_path):
    r = Rig(tmp_path, flush_delay=5)
    try:
        ino = r.write(ROOT_INO, b"f", b"old" * 1000)
        fh = r.vfs.open(ino, os.O_WRONLY | os.O_TRUNC)
        r.vfs.write(fh, 0, b"new")
        r.vfs.flush(fh)
        r.vfs.release(fh)
        r.drain()
        assert r.files() == {"f": b"new"}
        assert len([c for c in r.store.calls if c[0] == "commit"]) == 1   # the old one was superseded
    finally:
        r.stop()


def test_reopen_for_write_during_upload_does_not_touch_staged_bytes(tmp_path):
    gate = threading.Event()
    store = MemStore("mem://slow", faults=lambda op, p: gate.wait(5) if op == "stage" else None)
    r = Rig(tmp_path, store=store)
    try:
        ino = r.write(ROOT_INO, b"f", b"A" * 4096)
        r.p.hurry(r.meta.last_seq())
        time.sleep(0.2)                                 # staging has started and waits
        fh = r.vfs.open(ino, os.O_RDWR)
        r.vfs.write(fh, 0, b"B" * 10)
        gate.set()
        r.vfs.flush(fh)
        r.vfs.release(fh)
        r.drain()
        assert r.files()["f"] == b"B" * 10 + b"A" * 4086
        commits = [p for op, p in store.calls if op == "commit"]
        assert commits == ["f", "f"]                    # the first version, then the second
    finally:
        gate.set()
        r.stop()


def _staged_checkpoint(rig) -> None:
    """tmp-checkpoint-1/ with three files, renamed to checkpoint-1 before any of it lands."""
    tmp = rig.mkdir(ROOT_INO, b"tmp-checkpoint-1")
    rig.p.flush_delay = 5
    for i in range(3):
        rig.write(tmp, b"f%d" % i, b"x")
    rig.vfs.rename(ROOT_INO, b"tmp-checkpoint-1", ROOT_INO, b"checkpoint-1", 0)
    rig.drain()


def test_dir_rename_of_new_tree_is_free_and_of_persisted_tree_is_one_rename(rig):
    rig.store.atomic_dir_rename = False       # S3-like: a prefix moves object by object
    _staged_checkpoint(rig)
    assert rig.touched("tmp-checkpoint-1") == []
    assert sorted(rig.files()) == ["checkpoint-1/f0", "checkpoint-1/f1", "checkpoint-1/f2"]
    rig.vfs.rename(ROOT_INO, b"checkpoint-1", ROOT_INO, b"old-1", 0)
    rig.drain()
    assert [c for c in rig.store.calls if c[0] == "rename"] == [("rename", "checkpoint-1 -> old-1")]
    assert sorted(rig.files()) == ["old-1/f0", "old-1/f1", "old-1/f2"]


def test_dir_rename_of_new_tree_appears_whole_where_dir_renames_are_atomic(rig):
    """The staging pattern (tmp-checkpoint-N populated, renamed to checkpoint-N):
    on a store with atomic directory rename, checkpoint-N never shows half
    populated: the tree lands under its first name, then one rename."""
    _staged_checkpoint(rig)
    assert [c for c in rig.store.calls if "checkpoint-1" in c[1] and c[0] in ("commit", "rename")] \
        == [("commit", f"tmp-checkpoint-1/f{i}") for i in range(3)] \
        + [("rename", "tmp-checkpoint-1 -> checkpoint-1")]
    assert sorted(rig.files()) == ["checkpoint-1/f0", "checkpoint-1/f1", "checkpoint-1/f2"]


def test_delete_of_renamed_new_tree_leaves_nothing_to_apply(tmp_path):
    r = Rig(tmp_path, flush_delay=5)     # nothing of it lands before the delete
    try:
        tmp = r.mkdir(ROOT_INO, b"tmp-checkpoint-1")
        r.write(tmp, b"f", b"x")
        r.vfs.rename(ROOT_INO, b"tmp-checkpoint-1", ROOT_INO, b"checkpoint-1", 0)
        r.vfs.unlink(tmp, b"f")
        r.vfs.rmdir(ROOT_INO, b"checkpoint-1")
        assert r.meta.journal() == []
        r.drain()
        assert r.files() == {} and r.p.failed == {}
    finally:
        r.stop()


def test_rename_onto_persisted_target_replaces_it(rig):
    rig.write(ROOT_INO, b".metadata", b"v1")
    rig.drain()
    rig.write(ROOT_INO, b".metadata.tmp", b"v2")
    rig.vfs.rename(ROOT_INO, b".metadata.tmp", ROOT_INO, b".metadata", 0)
    rig.drain()
    assert rig.files() == {".metadata": b"v2"}


def test_transient_errors_are_retried(rig):
    rig.store.fail_next(3, ops="commit")
    rig.write(ROOT_INO, b"f", b"data")
    rig.drain(timeout=20)
    assert rig.files() == {"f": b"data"}


def test_permanent_error_is_reported_and_data_kept(rig):
    rig.store.fail_next(1, PermanentError("AccessDenied"), ops="commit")
    ino = rig.write(ROOT_INO, b"f", b"data")
    rig.p.hurry(rig.meta.last_seq())
    deadline = time.monotonic() + 5
    while not rig.p.failed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "AccessDenied" in rig.p.last_error
    assert rig.vfs.getxattr(ino, b"user.acache.state") == b"failed"
    rig.drain()                                  # hurry() retries it at once: now it works
    assert rig.files() == {"f": b"data"} and rig.p.last_error == ""


def test_unknown_xattr_is_enodata_and_ours_is_read_only(rig):
    ino = rig.write(ROOT_INO, b"f", b"x")
    with pytest.raises(FsError) as e:
        rig.vfs.getxattr(ino, b"user.other")
    assert e.value.errno == errno.ENODATA
    with pytest.raises(FsError) as e:
        rig.vfs.setxattr(ino, b"user.acache.state", b"persisted")
    assert e.value.errno == errno.EPERM


def crash_child(tmp: str) -> None:
    """Run in a child process: a closed file and an open fsynced one, nothing persisted
    (flush delay 60 s), then wait to be killed -9 with the file still open."""
    from acache.data.under.file import FileStore
    tmp_path = Path(tmp)
    r = Rig(tmp_path, store=FileStore(f"file://{tmp_path / 'ufs'}"),
            kv=RocksKV(str(tmp_path / "db")), flush_delay=60)
    r.write(ROOT_INO, b"closed", b"c" * 100)
    fh, attr = r.vfs.create(ROOT_INO, b"open", 0o644, os.O_WRONLY, CTX)
    r.vfs.write(fh, 0, b"o" * 50)
    r.vfs.fsync(fh, False)
    print("ready", flush=True)
    sys.stdin.read()                       # killed here: no flush, no close of anything


def test_crash_with_open_dirty_file_persists_it_after_restart(tmp_path):
    from acache.data.under.file import FileStore
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from tests.unit.test_vfs_journal import crash_child; "
         "crash_child(sys.argv[1])", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert child.stdout.readline().strip() == "ready"
    finally:
        child.kill()                       # a real kill -9 of the process holding it all
        child.wait(10)
    assert child.returncode == -signal.SIGKILL
    assert not os.listdir(tmp_path / "ufs")
    kv2 = RocksKV(str(tmp_path / "db"))
    r2 = Rig(tmp_path, store=FileStore(f"file://{tmp_path / 'ufs'}"), kv=kv2)
    try:
        assert r2.recovered["reopened"] == 1
        r2.drain()
        got = {p.name: p.read_bytes() for p in (tmp_path / "ufs").iterdir()}
        assert got == {"closed": b"c" * 100, "open": b"o" * 50}
    finally:
        r2.stop()
        kv2.close()


def test_read_through_fetches_in_large_chunks(tmp_path):
    state = MemState()
    blob = os.urandom(5 << 20)
    state.files["big"] = (blob, time.time())
    r = Rig(tmp_path, store=MemStore("mem://rt", state=state))
    try:
        attr = r.vfs.lookup(ROOT_INO, b"big", CTX)
        assert attr.size == len(blob)
        fh = r.vfs.open(attr.ino, os.O_RDONLY)
        import random
        rnd = random.Random(1)
        for _ in range(1000):
            off = rnd.randrange(0, len(blob) - 4096)
            assert r.vfs.read(fh, off, 4096) == blob[off:off + 4096]
        r.vfs.release(fh)
        reads = [c for c in r.store.calls if c[0] == "read"]
        assert len(reads) <= 5, reads                 # 5 chunks of 1 MiB, each fetched once
    finally:
        r.stop()


def _passes_after_staged(p: Persister, path: str) -> threading.Event:
    """An event set once the persister loop starts its second pass after the stage of
    ``path`` finished: the first of them has then made (and carried out) its decision."""
    ev, seen, real = threading.Event(), [0], p._schedule

    def schedule():
        if any(j.entry.path == path and j.done.is_set() for j in p.jobs.values()):
            seen[0] += 1
            if seen[0] >= 2:
                ev.set()
        return real()
    p._schedule = schedule
    return ev


def test_reopen_of_big_pending_file_is_held_in_place_not_copied(tmp_path):
    r = Rig(tmp_path, flush_delay=5)
    try:
        r.cache.CLONE_MAX = 0                    # every file counts as big here
        r.cache._reflink = False
        a = r.write(ROOT_INO, b"shard", b"A" * 1000)
        r.write(ROOT_INO, b"marker", b"m")
        fh = r.vfs.open(a, os.O_WRONLY)
        assert sorted(os.listdir(r.cache.dir)) == [f"{a:x}.0", f"{a + 1:x}.0"]   # no copy
        passes = _passes_after_staged(r.p, "marker")
        r.p.hurry(r.meta.last_seq())
        # the marker is staged (hurried), and a whole pass of the persister ran after
        # that: it committed nothing, the held shard keeps the marker waiting
        assert passes.wait(10), "the persister never ran a pass after staging the marker"
        assert [c for c in r.store.calls if c[0] == "commit"] == []   # the marker waits
        # a barrier on the marker alone cannot end before that close: its timeout says why
        with pytest.raises(FlushError, match="behind the PUT of shard, which waits for its "
                                             "writer to close it"):
            barrier.wait(r.meta, r.p, r.cache, (), "marker", 0.2, None, time.monotonic())
        with pytest.raises(FlushError, match="; the PUT of shard waits for its writer to close it"):
            barrier.wait(r.meta, r.p, r.cache, (), "", 0.2, None, time.monotonic())
        r.vfs.write(fh, 1000, b"B")
        r.vfs.flush(fh)
        r.vfs.release(fh)
        r.drain()
        assert [p for op, p in r.store.calls if op == "commit"] == ["shard", "marker"]
        assert r.files() == {"shard": b"A" * 1000 + b"B", "marker": b"m"}
    finally:
        r.stop()


def test_per_file_calls_do_not_scan_the_journal(tmp_path, monkeypatch):
    # rmtree/rename/close of one never-persisted file among many must cost O(1) journal
    # work: they go through the per-inode indexes, never a copy of the whole journal
    r = Rig(tmp_path, flush_delay=3600)
    try:
        d = r.mkdir(ROOT_INO, b"ck")
        inos = [r.write(d, b"f%d" % i, b"x" * 10) for i in range(50)]
        scans = []
        real = r.meta.journal
        monkeypatch.setattr(r.meta, "journal", lambda: scans.append(1) or real())
        r.write(d, b"f0", b"again")                                   # close supersedes a PUT
        r.vfs.rename(d, b"f1", d, b"g1", 0, CTX)                      # pending PUT moves
        for i in range(2, 50):
            r.vfs.unlink(d, b"f%d" % i, CTX)                          # pending PUT cancelled
        assert r.vfs.getxattr(d, b"user.acache.state") == b"dirty"    # dir state
        assert scans == []
        # f0's first PUT stays (f1.. were journaled after it), its second follows
        assert [e.path for e in real()] == ["ck", "ck/f0", "ck/f0", "ck/g1"]
        assert len(r.meta.puts_of(inos[0])) == 2 and r.meta.puts_of(inos[1])[0].path == "ck/g1"
    finally:
        r.stop()


@pytest.mark.parametrize("delay", [3600, 0])
def test_namespace_calls_wake_the_persister_only_when_it_would_sleep_too_long(tmp_path, delay):
    # every create/close/rename/unlink wakes the persister; waking it while it sleeps less
    # than the flush delay makes it rescan the journal's head under the lock for nothing
    # (once per namespace operation: a quarter of a rename's time on the native engine)
    r = Rig(tmp_path, flush_delay=delay)
    try:
        d = r.mkdir(ROOT_INO, b"ck")
        notified = []
        real = r.p.cond.notify_all
        r.p.cond.notify_all = lambda: notified.append(1) or real()
        for i in range(30):
            r.write(d, b"f%d" % i, b"x")
            r.vfs.rename(d, b"f%d" % i, d, b"g%d" % i, 0, CTX)
        for i in range(30):
            r.vfs.unlink(d, b"g%d" % i, CTX)
        if delay:
            assert len(notified) <= 2, len(notified)    # the persister sleeps <= 1 s at a time
        else:
            assert len(notified) >= 90                  # due at once: every wake counts
    finally:
        r.stop()


def test_packed_records_keep_their_format():
    # Inode/Entry.pack skip dataclasses.asdict (its deep copy cost 50 us a record): the
    # bytes in the KV must stay what asdict gave, so existing metadata reads back
    import dataclasses

    import msgpack

    from acache.meta.store import Entry, Inode
    recs = [Inode(7, 0o100644, name=b"\xff-not-utf8", upath="a/\udcff", dirty=True),
            Entry(3, "rename", "a", dst="b", inos=[4, 5], replaces=True)]
    for rec in recs:
        d = dataclasses.asdict(rec)
        if isinstance(rec, Entry):
            del d["t"]      # when it was journaled: memory only (a process-local clock)
        old = msgpack.packb(d, use_bin_type=True, unicode_errors="surrogateescape")
        assert rec.pack() == old
        assert type(rec).unpack(rec.pack()) == rec


def _create(rig, parent, name, data):
    fh, attr = rig.vfs.create(parent, name, 0o644, os.O_WRONLY, CTX)
    rig.vfs.write(fh, 0, data)
    return fh


def test_overlapping_closes_commit_in_parallel(tmp_path):
    # two closes that began before either returned (DESIGN.md point 4: order =
    # happens-before) may land in either order: their commits run at the same time.
    # Each commit waits for the other at a barrier: committed one at a time, it breaks
    both = threading.Barrier(2, timeout=10)
    met = []

    def faults(op, path):
        if op == "commit" and path.startswith("ck/shard"):
            both.wait()
            met.append(path)

    r = Rig(tmp_path, store=MemStore("mem://t", faults=faults))
    try:
        d = r.mkdir(ROOT_INO, b"ck")
        fhs = [_create(r, d, b"shard%d" % i, b"s%d" % i) for i in range(2)]
        with r.meta.op():        # both closes began here, before either returned
            for fh in fhs:
                r.vfs.flush(fh)
        for fh in fhs:
            r.vfs.release(fh)
        r.drain()
        assert sorted(met) == ["ck/shard0", "ck/shard1"]
        assert r.files() == {"ck/shard0": b"s0", "ck/shard1": b"s1"}
    finally:
        r.stop()


def test_closes_one_after_another_commit_in_order_even_when_staged_out_of_order(tmp_path):
    # shard0's stage is held until the later files are staged: their commits still wait
    # for it (each close returned before the next began), one at a time, in order
    later_staged = threading.Event()
    order, running, peak = [], [0], [0]
    lock = threading.Lock()

    def faults(op, path):
        if op == "stage" and path == "ck/shard0":
            assert later_staged.wait(10)
        elif op == "stage" and path == "ck/.metadata":
            later_staged.set()
        elif op == "commit":
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
                order.append(path)
            time.sleep(0.01)     # a commit that takes a while: others would overlap it
            with lock:
                running[0] -= 1

    r = Rig(tmp_path, store=MemStore("mem://t", faults=faults))
    r.p.concurrency = 4
    try:
        d = r.mkdir(ROOT_INO, b"ck")
        names = [b"shard%d" % i for i in range(3)] + [b".metadata"]
        for name in names:
            r.write(d, name, name)
        r.drain()
        assert order == ["ck/" + n.decode() for n in names]
        assert peak[0] == 1
    finally:
        r.stop()


def test_a_held_put_closed_again_waits_for_what_closed_before_that_close(tmp_path):
    # w and h closed together (overlapping: either may land first); h is reopened in
    # place (journal.hold_put) and closed again after w's close returned: what h commits
    # now was written after that, so it must not overtake w -- even when w's stage is slow
    h_committed = threading.Event()

    def faults(op, path):
        if op == "stage" and path == "w":
            h_committed.wait(3)      # set only if h overtakes w
        elif op == "commit" and path == "h":
            h_committed.set()

    r = Rig(tmp_path, store=MemStore("mem://t", faults=faults), flush_delay=5)
    try:
        r.cache.CLONE_MAX = 0                    # every file counts as big here
        r.cache._reflink = False
        fhs = [_create(r, ROOT_INO, b"w", b"w"), _create(r, ROOT_INO, b"h", b"A" * 1000)]
        with r.meta.op():
            for fh in fhs:
                r.vfs.flush(fh)
        for fh in fhs:
            r.vfs.release(fh)
        r.write(ROOT_INO, b"x", b"x")            # journaled after h: h is held, not re-put
        put = next(e for e in r.meta.journal() if e.path == "h")
        assert put.after < put.seq - 1           # may land before w, as closed then
        fh = r.vfs.open(put.ino, os.O_WRONLY)
        r.vfs.write(fh, 1000, b"B")
        r.vfs.flush(fh)
        r.vfs.release(fh)
        assert r.meta.entry(put.seq) is put and put.after == put.seq - 1   # kept its place
        r.drain()
        assert [p for op, p in r.store.calls if op == "commit"] == ["w", "h", "x"]
        assert r.files() == {"h": b"A" * 1000 + b"B", "w": b"w", "x": b"x"}
    finally:
        r.stop()


def test_fast_lookup_and_getattr_answer_from_memory_or_defer(rig):
    """The event-loop fast paths: the same answers as lookup()/getattr(), ENOENT for a
    missing name, and None (take the worker thread) when the lock is held elsewhere or the
    parent's under-storage entries are not merged yet."""
    d = rig.mkdir(ROOT_INO, b"d")
    ino = rig.write(d, b"f", b"abc")
    rig.drain()                                # the persister idle: nobody else takes the lock
    a = rig.vfs.lookup_fast(d, b"f")
    assert a is not None and (a.ino, a.size) == (ino, 3)
    assert rig.vfs.getattr_fast(ino) == rig.vfs.getattr(ino)
    with pytest.raises(FsError) as e:
        rig.vfs.lookup_fast(d, b"missing")
    assert e.value.errno == errno.ENOENT
    assert rig.vfs.lookup_fast(d, b"..") is None
    held, done = threading.Event(), threading.Event()

    def hold():
        with rig.meta.lock:
            held.set()
            done.wait(10)
    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        assert rig.vfs.lookup_fast(d, b"f") is None and rig.vfs.getattr_fast(ino) is None
    finally:
        done.set()
        t.join()
    rig.meta.get(d).listed = False             # as a directory of the under-storage not yet listed
    assert rig.vfs.lookup_fast(d, b"f") is None
