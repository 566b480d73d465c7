"""Data-safety rules of issue 9 on the VFS + persister over mem:// and the memory KV."""
import os
import time

import pytest

from acache.errors import ConfigError
from acache.data.under.mem import MemStore
from acache.fs.types import ROOT_INO
from acache.meta.kv_mem import MemKV
from tests.unit.test_vfs_journal import Rig


def _drained(rig, timeout):
    """Poll until the journal is empty (True) or the deadline passes (False)."""
    deadline = time.monotonic() + timeout
    while rig.meta.journal_len():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_pending_entries_start_within_flush_delay_after_a_reboot(tmp_path):
    """The first boot's clock had run for days; after the reboot the monotonic clock
    starts from 0 again: entries found at start are due flush_delay after the start,
    not after the first boot's uptime."""
    up_for_days = 5 * 86400.0
    t0 = time.monotonic()
    kv, store = MemKV(), MemStore("mem://t")
    r = Rig(tmp_path, store=store, kv=kv, flush_delay=1.0,
            clock=lambda: up_for_days + time.monotonic() - t0)
    r.write(ROOT_INO, b"shard", b"x" * 1000)
    r.stop()                             # "crash" before the flush delay ran out
    assert r.meta.journal_len() == 1 and r.files() == {}
    t1 = time.monotonic()
    r2 = Rig(tmp_path, store=store, kv=kv, flush_delay=1.0, clock=lambda: time.monotonic() - t1)
    try:
        assert _drained(r2, 30), "the pending PUT waits for the old boot's uptime"
        assert r2.files() == {"shard": b"x" * 1000}
    finally:
        r2.stop()


def _poll(cond, timeout=20):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_rename_of_a_removed_source_not_in_the_cache_fails_and_can_be_skipped(tmp_path):
    """The source of a pending rename was removed from the under-storage by another tool
    and the file's data is no longer in the cache: the rename fails permanently with the
    reason (no wedge without a way out); skipping it lets everything after it land."""
    r = Rig(tmp_path, flush_delay=5)
    try:
        d = r.mkdir(ROOT_INO, b"d")
        x = r.write(d, b"x", b"x" * 1000)
        r.drain()
        assert r.vfs.evict_cached(x, 0)                  # only the under-storage has it now
        r.vfs.rename(ROOT_INO, b"d", ROOT_INO, b"e", 0)
        with r.store.state.lock:
            r.store.state.files.pop("d/x")
            r.store.state.dirs.pop("d", None)
        r.write(ROOT_INO, b"after", b"later")
        r.p.hurry(r.meta.last_seq())
        _poll(lambda: r.p.failed)
        total, entries = r.p.entries()
        assert total == 2 and [(e["op"], e["state"]) for e in entries] == \
            [("rename", "failed"), ("put", entries[1]["state"])]
        assert "not in the cache" in entries[0]["error"] and "journal skip" in entries[0]["error"]
        with pytest.raises(ConfigError, match="no pending journal entry"):
            r.p.skip(12345, "no such entry")
        r.p.skip(entries[0]["seq"], "removed by hand")
        r.drain()
        assert r.files() == {"after": b"later"}
        assert r.p.failed == {} and r.p.last_error == ""
    finally:
        r.stop()


def test_rename_of_a_removed_source_is_written_again_from_the_cache(tmp_path):
    r = Rig(tmp_path, flush_delay=5)
    try:
        d = r.mkdir(ROOT_INO, b"d")
        r.mkdir(d, b"sub")
        r.write(d, b"x", b"x" * 1000)
        r.drain()
        r.vfs.rename(ROOT_INO, b"d", ROOT_INO, b"e", 0)
        with r.store.state.lock:
            r.store.state.files.pop("d/x")
            for k in [k for k in r.store.state.dirs if k == "d" or k.startswith("d/")]:
                r.store.state.dirs.pop(k)
        r.write(ROOT_INO, b"after", b"later")
        r.drain()
        assert r.files() == {"e/x": b"x" * 1000, "after": b"later"}
        assert "e/sub" in r.store.state.dirs
    finally:
        r.stop()


def test_no_under_storage_call_under_the_metadata_lock(tmp_path):
    """A failed commit aborts its stage (S3: AbortMultipartUpload, up to the read timeout
    in an outage) and cleans up: never while holding the lock every FUSE op needs."""
    held = []
    box = {}

    def watch(op, path):
        if "rig" in box:
            held.append((op, box["rig"].meta.lock._is_owned()))
    store = MemStore("mem://t", faults=watch)
    r = Rig(tmp_path, store=store)
    box["rig"] = r
    try:
        store.fail_next(1, ops="commit")
        r.write(ROOT_INO, b"f", b"x" * 100)
        r.drain()
        assert r.files() == {"f": b"x" * 100}
        assert ("abort", False) in held or ("cleanup", False) in held
        assert [op for op, locked in held if locked] == []
    finally:
        r.stop()


def test_failed_read_ahead_does_not_poison_its_chunk(tmp_path):
    """A read-ahead of chunk 1 fails (nobody waits for it); a later read of chunk 1
    fetches it again and gets the bytes, not the old error."""
    from acache.data.readthrough import ReadThrough
    from acache.errors import TransientError
    chunk = 4096
    data = os.urandom(4 * chunk)
    fails = {"left": 3}        # ReadThrough tries a read 3 times before giving up

    class Under:
        def read(self, path, off, n):
            if off == chunk and fails["left"]:
                fails["left"] -= 1
                raise TransientError("injected")
            return data[off:off + n]
    rt = ReadThrough(Under(), chunk, workers=2)
    fd = os.open(tmp_path / "c", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        rt.ensure(1, 0, fd, lambda: "f", len(data), 0, chunk)      # + read-ahead of 1..3
        _poll(lambda: not rt._fills[(1, 0)].loading)
        assert fails["left"] == 0                                  # chunk 1 failed
        rt.ensure(1, 0, fd, lambda: "f", len(data), chunk, chunk)
        assert os.pread(fd, chunk, chunk) == data[chunk:2 * chunk]
    finally:
        os.close(fd)
        rt.pool.shutdown()


def test_scoped_flush_does_not_rescan_the_journal_each_tick(tmp_path, monkeypatch):
    """`flush --wait PATH` finds what it waits for once; each wake-up only looks at those
    entries (it used to scan the whole journal and every job, per tick)."""
    from acache.meta.store import Entry
    from acache.node.backend import Single
    r = Rig(tmp_path, store=MemStore("mem://t", delay=0.01), flush_delay=30)
    try:
        a = r.mkdir(ROOT_INO, b"a")
        for i in range(40):
            r.write(a, b"f%d" % i, b"x" * 100)
        b = r.mkdir(ROOT_INO, b"b")
        r.write(b, b"last", b"y")
        n_entries = r.meta.journal_len()
        calls = {"n": 0}
        orig = Entry.touches

        def counting(self, prefix):
            calls["n"] += 1
            return orig(self, prefix)
        monkeypatch.setattr(Entry, "touches", counting)
        res = Single(r.meta, r.cache, r.p, r.vfs).barrier("b", 60, None)   # behind a/'s 40
        assert res["ok"] and r.files()["b/last"] == b"y"
        assert calls["n"] <= n_entries, f"{calls['n']} checks for {n_entries} entries"
    finally:
        r.stop()


def test_fsync_then_truncate_then_crash_is_not_taken_for_a_short_cache_file(tmp_path):
    """fsync at 1000 bytes, ftruncate to 10, crash while open: recovery publishes the
    10 bytes (the cut is the file's content), it does not fail it as 'short'."""
    from acache.fs.types import Ctx
    kv, store = MemKV(), MemStore("mem://t")
    r = Rig(tmp_path, store=store, kv=kv, flush_delay=30)
    fh, attr = r.vfs.create(ROOT_INO, b"f", 0o644, os.O_WRONLY, Ctx())
    r.vfs.write(fh, 0, b"x" * 1000)
    r.vfs.fsync(fh, False)
    r.vfs.setattr(attr.ino, fh=fh, size=10)
    r.stop()                                     # the crash: never closed
    r2 = Rig(tmp_path, store=store, kv=kv)
    try:
        r2.drain()
        assert r2.files() == {"f": b"x" * 10} and r2.p.failed == {}
    finally:
        r2.stop()
