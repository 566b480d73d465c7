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
