"""One KV suite for every implementation (RocksDB and memory)."""
import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from acache.meta.kv import open_kv

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["rocksdb", "mem"])
def kv(request, tmp_path):
    url = f"rocksdb://{tmp_path / 'db'}" if request.param == "rocksdb" else "mem://"
    k = open_kv(url)
    yield k
    k.close()


def test_get_put_delete(kv):
    assert kv.get(b"a") is None
    kv.write({b"a": b"1", b"b": b"2"})
    assert kv.get(b"a") == b"1"
    kv.write({}, [b"a"])
    assert kv.get(b"a") is None and kv.get(b"b") == b"2"


def test_batch_deletes_then_puts(kv):
    kv.write({b"k": b"old"})
    kv.write({b"k": b"new"}, [b"k"])
    assert kv.get(b"k") == b"new"


def test_scan_prefix_in_key_order(kv):
    kv.write({b"J\x00\x02": b"2", b"J\x00\x01": b"1", b"I\x00": b"i", b"J\x01\x00": b"3", b"K": b"k"})
    assert [k for k, _ in kv.scan(b"J")] == [b"J\x00\x01", b"J\x00\x02", b"J\x01\x00"]
    assert list(kv.scan(b"Z")) == []


def test_binary_values_synced_or_not(kv):
    blob = bytes(range(256)) * 10
    kv.write({b"\x00\xff": blob}, sync=True)
    kv.write({b"\xff\x00": blob[::-1]})
    assert kv.get(b"\x00\xff") == blob and kv.get(b"\xff\x00") == blob[::-1]


# -- RocksDB durability: what sync promises, observed ---------------------------------------------
class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted",
                                               "recently_evicted")]


def _unwritten_pages(path) -> int:
    """Pages of ``path`` in the page cache not yet on the disk (dirty or under writeback),
    from cachestat(2) (Linux >= 6.5)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        cs = _CacheStat()
        if libc.syscall(451, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(cs), 0) != 0:
            err = ctypes.get_errno()
            pytest.fail(f"cachestat(2) failed ({os.strerror(err)}): this test needs Linux >= 6.5")
        return cs.dirty + cs.writeback
    finally:
        os.close(fd)


def _wal_unwritten(db) -> int:
    wals = list(db.glob("*.log"))
    assert wals, f"no write-ahead log in {sorted(p.name for p in db.iterdir())}"
    return sum(_unwritten_pages(p) for p in wals)


def test_rocksdb_sync_write_is_on_the_disk_when_it_returns(tmp_path):
    """sync=True: the batch's WAL pages are written back (fsync) before write() returns,
    so none of the WAL is left dirty in the page cache.  The control: the same write
    with sync=False leaves WAL pages dirty (the check can see the difference; the kernel's
    own writeback could clean them meanwhile, hence a few tries)."""
    k = open_kv(f"rocksdb://{tmp_path / 'db'}")
    try:
        for i in range(5):
            k.write({b"s%d" % i: os.urandom(20000)}, sync=True)
            assert _wal_unwritten(tmp_path / "db") == 0, f"sync write {i}: WAL pages not on the disk"
        dirty_seen = 0
        for i in range(5):
            k.write({b"n%d" % i: os.urandom(20000)}, sync=False)
            dirty_seen += _wal_unwritten(tmp_path / "db") > 0
        assert dirty_seen, "sync=False never left the WAL dirty: the check cannot tell"
    finally:
        k.close()


_CHILD = """
import sys
from acache.meta.kv import open_kv
k = open_kv(sys.argv[1])
k.write({b"synced": b"1"}, sync=True)
k.write({b"unsynced": b"2", b"gone": b"3"})
k.write({}, [b"gone"])
print("written", flush=True)
sys.stdin.read()            # killed here: never closes the database
"""


def test_rocksdb_writes_survive_kill9_of_the_writer(tmp_path):
    """A process that wrote (synced or not) and is killed -9 before it closes the
    database: a new opener finds every acknowledged batch (the WAL reached the OS)."""
    url = f"rocksdb://{tmp_path / 'db'}"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, url], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert child.stdout.readline().strip() == "written"
    finally:
        child.kill()                                 # SIGKILL
        child.wait(10)
    assert child.returncode == -signal.SIGKILL, child.returncode
    k = open_kv(url)
    try:
        assert (k.get(b"synced"), k.get(b"unsynced"), k.get(b"gone")) == (b"1", b"2", None)
    finally:
        k.close()


def test_rocksdb_second_opener_gets_a_clear_error(tmp_path):
    from acache.errors import ConfigError
    url = f"rocksdb://{tmp_path / 'db'}"
    k = open_kv(url)
    with pytest.raises(ConfigError, match="metadata database"):
        open_kv(url)
    k.close()
