"""RequestLog (acache.cluster.requests): a request sent again is answered as its first run was,
from memory and -- after a head takeover: a new MetaStore over the same KV -- from the KV;
the reply lands in the same KV write as the request's effects (group commit's hold); the
last ``keep`` per node are kept."""
import errno
import threading

import pytest

from acache.cluster.requests import PREFIX, RequestLog, request_key
from acache.errors import FsError
from acache.fs.types import ROOT_INO
from acache.meta import schema as K
from acache.meta.kv_mem import MemKV
from acache.meta.store import MetaStore


class GroupKV(MemKV):
    """The in-memory KV written behind (as etcd is), recording what each write held."""
    group_commit = True

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[set[bytes]] = []

    def write(self, puts, deletes=(), sync=False):
        self.batches.append(set(puts) | set(deletes))
        super().write(puts, deletes, sync)


def mkdir(meta: MetaStore, name: bytes) -> dict:
    """What a namespace op does: change memory, commit one txn (queued behind)."""
    with meta.lock:
        if meta.child(ROOT_INO, name) is not None:
            raise FsError(errno.EEXIST)
        txn = meta.txn()
        node = meta.new_inode(txn, mode=0o040755, nlink=2, parent=ROOT_INO, name=name)
        txn.link(ROOT_INO, name, node.ino)
        txn.commit()
        return {"ino": node.ino}


def edge_of(meta: MetaStore):
    """The head's CallEdge in short: run, then wait until what it changed has landed."""
    def edge(fn):
        since = meta.mark()
        out = fn()
        meta.wait_visible(since)
        return out
    return edge


@pytest.fixture(params=["write-through", "group"])
def kv(request):
    return MemKV() if request.param == "write-through" else GroupKV()


def test_sent_again_answered_from_the_first_run(kv):
    meta = MetaStore(kv)
    log = RequestLog(meta, edge=edge_of(meta))
    calls = []

    def fn():
        calls.append(1)
        return mkdir(meta, b"d")
    first = log.run("n2", "n2:b:1", fn)
    assert log.run("n2", "n2:b:1", fn) == first and len(calls) == 1
    # a new request of the same op fails as it should (EEXIST), and so does its copy
    with pytest.raises(FsError) as ei:
        log.run("n2", "n2:b:2", fn)
    assert ei.value.errno == errno.EEXIST
    with pytest.raises(FsError) as ei:
        log.run("n2", "n2:b:2", lambda: pytest.fail("ran again"))
    assert ei.value.errno == errno.EEXIST
    # the same rid from another node is another request
    with pytest.raises(FsError):
        log.run("n3", "n2:b:1", fn)
    meta.close()


def test_a_new_head_answers_from_the_kv(kv):
    meta = MetaStore(kv)
    log = RequestLog(meta, edge=edge_of(meta))
    first = log.run("n2", "r1", lambda: mkdir(meta, b"d"))
    with pytest.raises(FsError):
        log.run("n2", "r2", lambda: mkdir(meta, b"d"))
    if meta.group is not None:
        meta.group.drain()
    # a takeover: a new store and log over the same KV
    meta2 = MetaStore(kv)
    log2 = RequestLog(meta2, edge=edge_of(meta2))
    assert log2.run("n2", "r1", lambda: pytest.fail("ran again")) == first
    with pytest.raises(FsError) as ei:
        log2.run("n2", "r2", lambda: pytest.fail("ran again"))
    assert ei.value.errno == errno.EEXIST
    assert log2.run("n2", "r3", lambda: mkdir(meta2, b"e"))["ino"] != first["ino"]
    meta.close()
    meta2.close()


def test_the_reply_lands_in_the_write_of_its_effects():
    kv = GroupKV()
    meta = MetaStore(kv)
    log = RequestLog(meta, edge=edge_of(meta))
    for i in range(20):
        out = log.run("n2", f"r{i}", lambda i=i: mkdir(meta, b"d%d" % i))
        dentry = K.dentry_key(ROOT_INO, b"d%d" % i)
        [batch] = [b for b in kv.batches if dentry in b]
        assert request_key("n2", f"r{i}") in batch, f"request {i}: reply in another write"
        assert out["ino"] == K.from_u64(kv.get(dentry))
    meta.close()


def test_a_hold_that_ran_out_writes_the_reply_behind():
    kv = GroupKV()
    meta = MetaStore(kv)
    assert meta.group is not None
    meta.group.HOLD_MAX = 0.0            # the writer does not wait: the batch goes at once
    log = RequestLog(meta, edge=edge_of(meta))

    def slow():
        out = mkdir(meta, b"d")
        with meta.group.cv:               # the writer took (and wrote) the batch already
            meta.group.cv.wait_for(lambda: meta.group.settled >= meta.group.issued, 10)
        return out
    out = log.run("n2", "r1", slow)
    dentry = K.dentry_key(ROOT_INO, b"d")
    [batch] = [b for b in kv.batches if dentry in b]
    assert request_key("n2", "r1") not in batch
    assert kv.get(request_key("n2", "r1")) is not None      # written right behind
    meta2 = MetaStore(kv)
    assert RequestLog(meta2).run("n2", "r1", lambda: pytest.fail("ran again")) == out
    meta.close()
    meta2.close()


def test_only_the_last_keep_per_node(kv):
    meta = MetaStore(kv)
    log = RequestLog(meta, keep=3, edge=edge_of(meta))
    for i in range(5):
        log.run("n2", f"r{i}", lambda i=i: {"i": i})
    log.run("n3", "x", lambda: {"x": 1})
    if meta.group is not None:
        meta.group.drain()
    keys = sorted(k for k, _ in kv.scan(PREFIX))
    assert keys == sorted([request_key("n2", f"r{i}") for i in (2, 3, 4)] + [request_key("n3", "x")])
    assert log.stored("n2") == ["r2", "r3", "r4"]
    meta2 = MetaStore(kv)
    log2 = RequestLog(meta2, keep=3)
    assert log2.stored("n2") == ["r2", "r3", "r4"]
    assert log2.run("n2", "r4", lambda: pytest.fail("ran again")) == {"i": 4}
    assert log2.run("n2", "r0", lambda: {"again": True}) == {"again": True}   # trimmed: runs
    log2.run("n2", "r5", lambda: {})
    if meta2.group is not None:
        meta2.group.drain()
    assert log2.stored("n2") == ["r4", "r0", "r5"]
    assert len([k for k, _ in kv.scan(PREFIX + b"n2\0")]) == 3
    meta.close()
    meta2.close()


def test_not_durable_requests_are_not_stored(kv):
    meta = MetaStore(kv)
    log = RequestLog(meta, edge=edge_of(meta))
    assert log.run("n2", "r1", lambda: {"v": 1}, durable=False) == {"v": 1}
    assert log.run("n2", "r1", lambda: pytest.fail("ran again"), durable=False) == {"v": 1}
    if meta.group is not None:
        meta.group.drain()
    assert list(kv.scan(PREFIX)) == []
    assert log.run("n2", "", lambda: {"v": 2}) == {"v": 2}       # no rid: nothing kept
    meta.close()


def test_a_copy_in_flight_waits_for_the_first(kv):
    meta = MetaStore(kv)
    log = RequestLog(meta, edge=edge_of(meta))
    entered, go = threading.Event(), threading.Event()
    runs = []

    def first():
        runs.append(1)
        entered.set()
        assert go.wait(10)
        return mkdir(meta, b"d")
    got: list = []
    t = threading.Thread(target=lambda: got.append(log.run("n2", "r1", first)))
    t.start()
    assert entered.wait(10)
    t2 = threading.Thread(target=lambda: got.append(log.run("n2", "r1", lambda: pytest.fail("twice"))))
    t2.start()
    go.set()
    t.join(10)
    t2.join(10)
    assert len(runs) == 1 and len(got) == 2 and got[0] == got[1]
    meta.close()
