"""Data-safety rules of issue 9 on the VFS + persister over mem:// and the memory KV."""
import os
import time

import pytest

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
        assert r.vfs._evict(x, 0)                  # only the under-storage has it now
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
        with pytest.raises(Exception):
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
