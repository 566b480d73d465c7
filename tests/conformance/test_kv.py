"""One KV suite for every implementation (RocksDB, memory and etcd)."""
import ctypes
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from acache.meta.kv import open_kv

REPO = Path(__file__).resolve().parents[2]


def _url(kind, request, tmp_path) -> str:
    if kind == "rocksdb":
        return f"rocksdb://{tmp_path / 'db'}"
    if kind == "etcd":
        return request.getfixturevalue("etcd1").url(request.getfixturevalue("etcd_name"))
    return "mem://"


@pytest.fixture(params=["rocksdb", "mem", "etcd"])
def kv(request, tmp_path):
    k = open_kv(_url(request.param, request, tmp_path))
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


def test_big_batch_over_128_ops_is_atomic(kv):
    """A batch of 400 puts and 150 deletes (over etcd's 128 ops per txn) lands whole: a
    scanner running meanwhile sees the batch before or after, never a mix."""
    kv.write({b"B%04d" % i: b"old" for i in range(300)})
    stop, seen, bad = threading.Event(), [], []

    def scanner():
        while not stop.is_set():
            got = dict(kv.scan(b"B"))
            state = (len(got), frozenset(got.values()))
            seen.append(state)
            if state not in {(300, frozenset({b"old"})), (400, frozenset({b"new"}))}:
                bad.append(state)

    t = threading.Thread(target=scanner)
    t.start()
    try:
        kv.write({b"B%04d" % i: b"new" for i in range(150, 550)}, [b"B%04d" % i for i in range(150)])
    finally:
        stop.set()
        t.join(60)
    got = dict(kv.scan(b"B"))
    assert sorted(got) == [b"B%04d" % i for i in range(150, 550)] and set(got.values()) == {b"new"}
    assert not bad, f"a scan saw half a batch: {bad[:3]}"
    assert seen, "the scanner never ran"


def test_big_batch_over_1_5_mib_is_atomic(kv):
    """A few values but 3 MiB in all (over etcd's 1.5 MiB per request), binary keys."""
    vals = {b"M\x00" + bytes([i]) + b"\xff": os.urandom(300_000) for i in range(10)}
    kv.write({b"M\x00\x05\xff": b"x", b"Mgone": b"y"})
    kv.write(vals, [b"Mgone"])
    assert dict(kv.scan(b"M")) == vals
    assert kv.get(b"Mgone") is None


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


# -- etcd: big batches across a crash of the writer; the fence ------------------------------------
_ETCD_CHILD = """
import os, signal, sys
from acache.meta.kv_etcd import EtcdKV
kv = EtcdKV.open(sys.argv[1], compact=False)
kv.write({b"P%04d" % i: b"before" for i in range(200)})
def hook(stage, _kv=kv):
    if stage == sys.argv[2]:
        print("killed at", stage, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
kv._hook = hook
kv.write({b"P%04d" % i: b"after" for i in range(100, 400)}, [b"P%04d" % i for i in range(100)])
print("not killed", flush=True)
"""


def _raw(etcd1, name: str, under: str) -> list:
    from acache.meta.etcd import EtcdClient
    c = EtcdClient(etcd1.endpoints)
    try:
        return [kv.key for kv in c.range_prefix(f"/acache/{name}/{under}".encode())]
    finally:
        c.close()


@pytest.mark.parametrize("stage,applied", [("chunks-written", False), ("intent-committed", True),
                                           ("applied-chunk", True), ("applied", True)])
def test_etcd_big_batch_survives_kill9_of_the_writer(etcd1, etcd_name, stage, applied):
    """The writer is killed -9 inside a 400-op batch: before its commit point (the intent) the
    batch is not applied at all; after it, the next opener applies it -- exactly once: a write
    after the recovery is not undone by a later opener, and no intent data is left."""
    url = etcd1.url(etcd_name, compact=0)
    child = subprocess.run([sys.executable, "-c", _ETCD_CHILD, url, stage], capture_output=True,
                           text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert child.returncode == -signal.SIGKILL, (child.returncode, child.stdout, child.stderr)
    assert f"killed at {stage}" in child.stdout
    assert _raw(etcd1, etcd_name, "kvmeta/intent-data/"), "the child left no chunk records"
    k = open_kv(url)
    try:
        got = dict(k.scan(b"P"))
        want = ({b"P%04d" % i: b"after" for i in range(100, 400)} if applied
                else {b"P%04d" % i: b"before" for i in range(200)})
        assert got == want
        k.write({b"P0150": b"later"})
    finally:
        k.close()
    assert _raw(etcd1, etcd_name, "kvmeta/intent") == [], "intent records left after recovery"
    k = open_kv(url)
    try:
        assert k.get(b"P0150") == b"later", "the batch was applied a second time"
        assert len(dict(k.scan(b"P"))) == len(want)
    finally:
        k.close()


def test_etcd_reader_finishes_a_pending_intent(etcd1, etcd_name):
    """A read between the intent's commit and its application answers the whole batch."""
    from acache.meta.kv_etcd import EtcdKV
    k = EtcdKV.open(etcd1.url(etcd_name), compact=False)
    seen = {}

    def hook(stage):
        if stage == "intent-committed":
            seen["mid"] = (k.get(b"R0000"), k.get(b"R0299"), len(dict(k.scan(b"R"))))
    k._hook = hook
    try:
        k.write({b"R%04d" % i: b"v" for i in range(300)})
        assert seen["mid"] == (b"v", b"v", 300)
    finally:
        k.close()


def test_etcd_second_opener_fences_off_the_first(etcd1, etcd_name):
    from acache.errors import MetaError
    url = etcd1.url(etcd_name, compact=0)
    a = open_kv(url)
    a.write({b"k": b"a"})
    b = open_kv(url)
    try:
        with pytest.raises(MetaError, match="fenced off"):
            a.write({b"k": b"stale"})
        b.write({b"k": b"b"})
        assert b.get(b"k") == b"b"
    finally:
        a.close()
        b.close()


def test_etcd_value_over_the_request_limit_is_refused_whole(etcd1, etcd_name):
    from acache.errors import MetaError
    k = open_kv(etcd1.url(etcd_name, compact=0))
    try:
        with pytest.raises(MetaError, match="limit"):
            k.write({b"small": b"1", b"huge": b"x" * (2 << 20)})
        assert k.get(b"small") is None
    finally:
        k.close()
