"""Stages that only read the cache file (UnderStore.local_stage: an S3 small file) run on
the persister's own thread between commits, not on a stager thread: the same order, the
same cancellations, no thread hop per entry."""
import threading

import pytest

from acache.fs.types import ROOT_INO
from tests.unit.test_vfs_journal import Rig


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path, flush_delay=0.0)
    r.store.local_stages = True
    yield r
    r.stop()


def committed(rig):
    return [path for op, path in rig.store.calls if op == "commit"]


def test_local_stages_run_on_the_persister_thread_and_commit_in_close_order(rig):
    threads = set()

    def faults(op, path):
        if op == "stage":
            threads.add(threading.current_thread().name)
    rig.store.faults = faults
    d = rig.mkdir(ROOT_INO, b"ck")
    names = [b"shard%02d" % i for i in range(20)] + [b".metadata"]
    for n in names:
        rig.write(d, n, n * 3)
    rig.drain()
    assert threads == {"acache-persister"}
    assert committed(rig) == ["ck/" + n.decode() for n in names]
    assert rig.files() == {"ck/" + n.decode(): n * 3 for n in names}
    with rig.p.lock:
        assert rig.p._staging == {} and rig.p._inline == []


def test_stores_without_local_stages_keep_the_stager_threads(tmp_path):
    r = Rig(tmp_path, flush_delay=0.0)      # MemStore answers False by default
    threads = set()
    r.store.faults = lambda op, path: threads.add(threading.current_thread().name) \
        if op == "stage" else None
    try:
        r.write(ROOT_INO, b"f", b"x")
        r.drain()
        assert threads and all(t.startswith("acache-stage") for t in threads)
    finally:
        r.stop()


def test_a_local_stage_cancelled_while_it_runs_is_thrown_away(rig):
    """The file is deleted while its (inline) stage reads it: nothing lands, its stage
    is cleaned up, the next file persists."""
    def faults(op, path):
        if op == "stage" and path == "gone":
            rig.vfs.unlink(ROOT_INO, b"gone")      # on the persister thread, unlocked
    rig.store.faults = faults
    rig.write(ROOT_INO, b"gone", b"g" * 10)
    rig.write(ROOT_INO, b"kept", b"k" * 10)
    rig.drain()
    assert rig.files() == {"kept": b"k" * 10}
    assert rig.store.state.staged == {}
    with rig.p.lock:
        assert rig.p._staging == {} and not rig.p.jobs


def test_a_failed_local_stage_is_retried(rig):
    rig.store.fail_next(2, ops="stage")
    rig.write(ROOT_INO, b"f", b"x" * 10)
    rig.p.hurry(rig.meta.last_seq())
    rig.drain(timeout=20)
    assert rig.files() == {"f": b"x" * 10}
    assert [op for op, _ in rig.store.calls].count("stage") == 3
