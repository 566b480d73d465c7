"""Persister.uses(ino, gen) from an index of the running stages, not a scan of the jobs
(it is asked at every unlink and cache gc): the index stays exact as stages start, end,
are aborted and are started again."""
import threading

import pytest

from acache.fs.types import ROOT_INO
from tests.unit.test_vfs_journal import Rig


class NoScan(dict):
    """The persister's jobs, refusing to be walked."""

    def _refuse(self, *a):
        raise AssertionError("uses() walked the jobs")
    values = items = keys = __iter__ = _refuse


@pytest.fixture
def gated(tmp_path):
    """A rig whose stages wait for ``gate`` (and say when one has begun)."""
    gate, begun = threading.Event(), threading.Event()

    def faults(op, path):
        if op == "stage":
            begun.set()
            assert gate.wait(10), "the test never opened the gate"
    r = Rig(tmp_path, flush_delay=0.0)
    r.store.faults = faults
    yield r, gate, begun
    gate.set()
    r.stop()


def staging(rig, ino):
    with rig.p.lock:
        node = rig.meta.get(ino)
        return node.gen, rig.p.uses(ino, node.gen)


def test_uses_does_not_walk_the_jobs(gated):
    rig, gate, begun = gated
    ino = rig.write(ROOT_INO, b"f", b"x" * 100)
    rig.p.hurry(rig.meta.last_seq())
    assert begun.wait(10)
    with rig.p.lock:          # nothing of the persister runs meanwhile
        jobs, rig.p.jobs = rig.p.jobs, NoScan(rig.p.jobs)
        try:
            gen = rig.meta.get(ino).gen
            assert rig.p.uses(ino, gen)
        finally:
            rig.p.jobs = jobs


def test_uses_is_exact_as_stages_start_and_end(gated):
    rig, gate, begun = gated
    ino = rig.write(ROOT_INO, b"f", b"x" * 100)
    other = rig.write(ROOT_INO, b"g", b"y" * 100)
    rig.p.hurry(rig.meta.last_seq())
    assert begun.wait(10)
    gen, used = staging(rig, ino)
    assert used
    with rig.p.lock:
        assert not rig.p.uses(ino, gen + 1) and not rig.p.uses(ino + 1000, gen)
    gate.set()
    rig.drain()
    with rig.p.lock:
        assert not rig.p.uses(ino, gen) and not rig.p.uses(other, rig.meta.get(other).gen)
        assert rig.p._staging == {} and rig.p._staging_of == {}
    assert rig.files() == {"f": b"x" * 100, "g": b"y" * 100}


def test_uses_ends_when_a_stage_is_cancelled_and_counts_a_restarted_one(gated):
    rig, gate, begun = gated
    ino = rig.write(ROOT_INO, b"f", b"x" * 100)
    rig.p.hurry(rig.meta.last_seq())
    assert begun.wait(10)
    gen, used = staging(rig, ino)
    assert used
    rig.vfs.unlink(ROOT_INO, b"f")          # cancels the PUT: its stage is aborted
    with rig.p.lock:
        assert not rig.p.uses(ino, gen) and rig.p._staging_of == {}
    begun.clear()
    ino2 = rig.write(ROOT_INO, b"h", b"z" * 10)
    rig.p.hurry(rig.meta.last_seq())
    gate.set()                               # the aborted stage ends, the new one runs
    rig.drain()
    with rig.p.lock:
        assert not rig.p.uses(ino2, rig.meta.get(ino2).gen) and rig.p._staging == {}
    assert rig.files() == {"h": b"z" * 10}
