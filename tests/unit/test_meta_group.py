"""Group commit (store.GroupCommit): a KV whose write is a slow round trip (etcd) is written
behind the MetaStore's lock, several callers' batches in one write, and nothing is lost or
half-applied when a write fails.

The KV here is the in-memory one with a write latency (an etcd txn waits for a WAL fsync) and a
gate that holds a write until the test lets it go, so every interleaving below is made by
events, not by timing."""
import errno
import threading
import time

import pytest

from acache.errors import MetaError
from acache.fs.types import ROOT_INO, Ctx
from acache.meta import schema as K
from acache.meta.kv_mem import MemKV
from acache.meta.store import MetaStore
from tests.unit.test_meta_rollback import memory, stored
from tests.unit.test_vfs_journal import Rig

CTX = Ctx()


class SlowKV(MemKV):
    group_commit = True

    def __init__(self, latency: float = 0.004) -> None:
        super().__init__()
        self.latency = latency
        self.writes = 0
        self.fail = False
        self.hold = False              # the next write waits in `entered`/`release`
        self.entered = threading.Event()
        self.release = threading.Event()

    def write(self, puts, deletes=(), sync=False):
        if self.hold:
            self.hold = False
            self.entered.set()
            assert self.release.wait(10), "the test never let the held write go"
        time.sleep(self.latency)       # the round trip (etcd: a WAL fsync)
        if self.fail:
            raise OSError(errno.EIO, "etcd: no leader")
        self.writes += 1
        super().write(puts, deletes, sync)


def _mkdir(meta: MetaStore, name: bytes) -> tuple[int, int]:
    """A directory made as the VFS makes one (inode, dentry, MKDIR entry), under the lock."""
    with meta.lock:
        txn = meta.txn()
        node = meta.new_inode(txn, mode=0o040755, nlink=2, parent=ROOT_INO, name=name)
        txn.link(ROOT_INO, name, node.ino)
        txn.append(op="mkdir", path=name.decode(), ino=node.ino)
        txn.commit()
        return node.ino, txn.ticket


@pytest.fixture
def kv():
    return SlowKV()


@pytest.fixture
def meta(kv):
    m = MetaStore(kv)
    assert m.group is not None
    yield m
    m.close()


def test_concurrent_callers_share_kv_writes_and_all_land(meta, kv):
    commits, threads = 25, 8
    base = kv.writes
    errors = []

    def work(t):
        try:
            for i in range(commits):
                _, ticket = _mkdir(meta, b"d%d-%d" % (t, i))
                meta.wait_ticket(ticket)          # acknowledged: in the KV from here on
                assert kv.get(K.dentry_key(ROOT_INO, b"d%d-%d" % (t, i))) is not None
        except BaseException as e:              # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    n = commits * threads
    # written through, it would be one KV write per commit; grouped, far fewer
    assert kv.writes - base < n / 2, (kv.writes - base, n)
    assert memory(meta) == stored(kv)
    assert len(meta.children(ROOT_INO)) == n


def test_a_failed_group_fails_every_batch_behind_it_and_memory_returns_to_the_kv(meta, kv):
    _, t0 = _mkdir(meta, b"before")
    meta.wait_ticket(t0)
    kv.hold = True
    _, t1 = _mkdir(meta, b"one")                # the writer takes it and is held in the KV
    assert kv.entered.wait(10)
    _, t2 = _mkdir(meta, b"two")                # queued behind it, built on its memory
    _, t3 = _mkdir(meta, b"three")
    assert meta.child(ROOT_INO, b"three") is not None     # memory runs ahead of the KV
    kv.fail = True
    kv.release.set()
    for t in (t1, t2, t3):
        with pytest.raises(MetaError):
            meta.wait_ticket(t)
    meta.wait_ticket(t0)                        # landed before: still fine
    meta.heal(None)                             # (the writer does it too; it is idempotent)
    assert meta.child(ROOT_INO, b"one") is None and meta.child(ROOT_INO, b"three") is None
    assert memory(meta) == stored(kv)
    kv.fail = False
    _, t4 = _mkdir(meta, b"after")
    meta.wait_ticket(t4)
    assert memory(meta) == stored(kv)
    assert meta.child(ROOT_INO, b"after") is not None and meta.child(ROOT_INO, b"before") is not None


def test_a_commit_while_broken_fails_and_heals(meta, kv):
    kv.hold = True
    _, t1 = _mkdir(meta, b"one")
    assert kv.entered.wait(10)
    kv.fail = True
    kv.release.set()
    with pytest.raises(MetaError):
        meta.wait_ticket(t1)
    kv.fail = False
    # whether the writer has undone it yet or not, this commit cannot build on "one"
    try:
        _, t2 = _mkdir(meta, b"two")
        meta.wait_ticket(t2)
    except MetaError:
        _, t2 = _mkdir(meta, b"two")           # undone by the failed commit: now it goes in
        meta.wait_ticket(t2)
    assert meta.child(ROOT_INO, b"one") is None
    assert memory(meta) == stored(kv)


def test_cleanup_waits_for_its_batch_and_is_dropped_if_it_fails(meta, kv):
    ran = []
    kv.hold = True
    _mkdir(meta, b"one")
    assert kv.entered.wait(10)
    with meta.lock:
        meta.after_durable(lambda: ran.append("one"))
    assert ran == []                            # its batch is still in the KV's hands
    kv.release.set()
    meta.group.drain()
    deadline = time.monotonic() + 10
    while not ran:                              # run by the helper thread, under the lock
        assert time.monotonic() < deadline
        with meta.lock:
            pass
        time.sleep(0.001)
    assert ran == ["one"]
    kv.hold, kv.entered, kv.release = True, threading.Event(), threading.Event()
    _, t2 = _mkdir(meta, b"two")
    assert kv.entered.wait(10)
    with meta.lock:
        meta.after_durable(lambda: ran.append("two"))
    kv.fail = True
    kv.release.set()
    with pytest.raises(MetaError):
        meta.wait_ticket(t2)
    meta.heal(None)
    meta.group.close()                          # the helper has run all it ever will
    assert ran == ["one"]


def test_sync_commit_and_sync_return_landed(meta, kv):
    with meta.lock:
        txn = meta.txn()
        node = meta.new_inode(txn, mode=0o100644, nlink=1, parent=ROOT_INO, name=b"f")
        txn.link(ROOT_INO, b"f", node.ino)
        txn.commit(sync=True)
        assert kv.get(K.inode_key(node.ino)) is not None
    _mkdir(meta, b"d")
    meta.sync()
    assert kv.get(K.dentry_key(ROOT_INO, b"d")) is not None


def test_vfs_and_persister_over_a_grouped_kv(tmp_path):
    """The whole single-host stack on a KV written behind: files written from several threads
    all land in the under-storage, the journal empties, and the KV agrees with memory."""
    kv = SlowKV(latency=0.002)
    rig = Rig(tmp_path, kv=kv, flush_delay=0)
    try:
        d = rig.mkdir(ROOT_INO, b"ck")
        errors = []

        def writer(t):
            try:
                for i in range(15):
                    rig.write(d, b"r%d-%d" % (t, i), b"%d:%d|" % (t, i) * 300)
            except BaseException as e:          # pragma: no cover - reported below
                errors.append(e)

        ts = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors
        rig.drain(timeout=60)
        files = rig.files()
        for t in range(4):
            for i in range(15):
                assert files[f"ck/r{t}-{i}"] == b"%d:%d|" % (t, i) * 300
        rig.meta.sync()
        assert memory(rig.meta) == stored(kv)
        assert not list(kv.scan(K.JOURNAL_PREFIX))
    finally:
        rig.stop()
        rig.meta.close()


def test_an_acknowledgement_fails_only_for_what_it_made_or_read_of_a_failed_group(meta, kv):
    kv.hold = True
    since = meta.mark()
    _, t1 = _mkdir(meta, b"one")               # an operation whose batch will fail
    assert kv.entered.wait(10)
    # another operation begins while that batch is in flight; it makes its change only after
    # the failure was undone, so its own batch lands: acknowledged, though it began before
    began, healed, res = threading.Event(), threading.Event(), {}

    def later_writer():
        s = meta.mark()
        began.set()
        assert healed.wait(10)
        _mkdir(meta, b"two")
        try:
            meta.wait_visible(s)
            res["ok"] = True
        except MetaError as e:
            res["error"] = e

    w = threading.Thread(target=later_writer)
    w.start()
    assert began.wait(10)
    kv.fail = True
    kv.release.set()
    with pytest.raises(MetaError):
        meta.wait_visible(since)               # its own batch failed
    meta.heal(None)
    kv.fail = False
    healed.set()
    w.join()
    assert res == {"ok": True}, res
    assert kv.get(K.dentry_key(ROOT_INO, b"two")) is not None
    assert kv.get(K.dentry_key(ROOT_INO, b"one")) is None
    out = {}
    marked, failed = threading.Event(), threading.Event()

    def read_only():                            # a lookup: makes nothing, reads memory
        since = meta.mark()
        marked.set()
        assert failed.wait(10)
        try:
            meta.wait_visible(since)
            out["ok"] = True
        except MetaError as e:
            out["error"] = e

    kv.hold, kv.entered, kv.release = True, threading.Event(), threading.Event()
    _, t3 = _mkdir(meta, b"three")
    assert kv.entered.wait(10)
    t = threading.Thread(target=read_only)
    t.start()
    assert marked.wait(10)
    assert meta.child(ROOT_INO, b"three") is not None   # what it could have read
    kv.fail = True
    kv.release.set()
    with pytest.raises(MetaError):
        meta.wait_ticket(t3)
    failed.set()
    t.join()
    assert "error" in out, out


def _close(meta: MetaStore, name: bytes, seen: dict) -> dict:
    """What the head's close_write does to the namespace: journal a PUT (under the lock)."""
    with meta.op(), meta.lock:
        txn = meta.txn()
        node = meta.new_inode(txn, mode=0o100644, nlink=1, parent=ROOT_INO, name=name)
        txn.link(ROOT_INO, name, node.ino)
        e = txn.append(op="put", path=name.decode(), ino=node.ino, gen=1, size=0)
        txn.commit()
    seen[name] = e
    return {}


def test_head_calls_order_closes_by_what_had_replied_and_ack_when_landed(meta, kv):
    from acache.cluster.head import CallEdge
    edge = CallEdge(meta)
    seen, done = {}, {}

    def call(name):
        try:
            done[name] = edge.run(_close, meta, name, seen)
        except MetaError as e:
            done[name] = e

    kv.hold = True
    x = threading.Thread(target=call, args=(b"x",))
    x.start()
    assert kv.entered.wait(10)                  # X journaled; its batch is being written
    assert b"x" not in done                     # not acknowledged before it landed
    y = threading.Thread(target=call, args=(b"y",))
    y.start()
    deadline = time.monotonic() + 10
    while b"y" not in seen:                     # Y journaled (its ack waits behind X's write)
        assert time.monotonic() < deadline
        time.sleep(0.001)
    kv.release.set()
    x.join()
    y.join()
    assert done == {b"x": {}, b"y": {}}
    ex, ey = seen[b"x"], seen[b"y"]
    assert ey.seq > ex.seq
    # Y's call arrived while X's was in flight: they overlapped, Y need not wait for X
    assert ey.after < ex.seq, (ey.after, ex.seq)
    call(b"z")                                  # after both replied: lands after both
    assert seen[b"z"].after >= ey.seq
    # a call whose batch fails is answered with the error, not acknowledged
    kv.hold, kv.entered, kv.release = True, threading.Event(), threading.Event()
    w = threading.Thread(target=call, args=(b"w",))
    w.start()
    assert kv.entered.wait(10)
    kv.fail = True
    kv.release.set()
    w.join()
    assert isinstance(done[b"w"], MetaError)
    meta.heal(None)
    assert meta.child(ROOT_INO, b"w") is None and meta.child(ROOT_INO, b"z") is not None


def _lazy_mkdir(meta: MetaStore, name: bytes, linger: float = 0.0) -> int:
    with meta.lock:
        txn = meta.txn()
        node = meta.new_inode(txn, mode=0o040755, nlink=2, parent=ROOT_INO, name=name)
        txn.link(ROOT_INO, name, node.ino)
        txn.commit(lazy=True, linger=linger)
        return txn.ticket


def test_a_lazy_batch_shares_the_next_batchs_kv_write(meta, kv):
    """A lazy batch (a head's end of a session) waits for company: the next batch takes it
    along, one KV write for both; on its own it still lands (its submitter's wait)."""
    meta.group.LINGER = 60.0            # only the next batch can send it
    base = kv.writes
    kv.hold = True                      # the next KV write waits at the gate (kv.entered)
    lazy = _lazy_mkdir(meta, b"lazy")
    # an idle writer takes a batch within microseconds: half a second without a write
    # means the lazy one waits (an event cannot show that nothing happened)
    assert not kv.entered.wait(0.5), "the lazy batch was written on its own"
    _, ticket = _mkdir(meta, b"next")
    assert kv.entered.wait(10)
    kv.release.set()
    meta.wait_ticket(ticket)
    assert kv.writes == base + 1, "the lazy batch was written on its own"
    assert meta.group.settled >= lazy
    assert kv.get(K.dentry_key(ROOT_INO, b"lazy")) is not None    # landed, with the next
    meta.group.LINGER = 0.002
    t = _lazy_mkdir(meta, b"alone")
    meta.wait_ticket(t)                 # by its submitter: it lingers, then goes alone
    assert kv.writes == base + 2


def test_anothers_wait_sends_a_lazy_batch_at_once(meta, kv):
    meta.group.LINGER = 60.0
    ticket = _lazy_mkdir(meta, b"lazy")
    done = threading.Event()

    def other():
        meta.wait_ticket(ticket)        # someone else needs it: no lingering for them
        done.set()

    th = threading.Thread(target=other)
    th.start()
    th.join(20)
    assert done.is_set(), "another thread's wait left the lazy batch lingering"


def test_a_patient_wait_leaves_a_lazy_batch_waiting_for_company(meta, kv):
    """The persister's stager waits for its stage's record patiently: the record still waits
    for the next batch, and both go in one KV write."""
    meta.group.LINGER = 60.0
    base = kv.writes
    ticket = _lazy_mkdir(meta, b"stage-record")
    done = threading.Event()

    def stager():
        meta.wait_ticket(ticket, patient=True)
        done.set()

    th = threading.Thread(target=stager)
    th.start()
    # half a second without the wait ending means the batch lingers (see the test above)
    assert not done.wait(0.5), "a patient wait sent the lazy batch on its own"
    _, firm = _mkdir(meta, b"next")
    meta.wait_ticket(firm)
    th.join(20)
    assert done.is_set()
    assert kv.writes == base + 1, "the lazy batch was written on its own"


def test_a_long_lingering_batch_does_not_hold_back_a_shorter_one_behind_it(meta, kv):
    """An applied entry's record may wait 50 ms for company, a stage's record 2 ms (a stager
    waits for it): the second is not held behind the first, and takes it along."""
    base = kv.writes
    kv.hold = True
    long = _lazy_mkdir(meta, b"applied", linger=60.0)
    short = _lazy_mkdir(meta, b"staged", linger=0.05)
    assert kv.entered.wait(10), "the short linger did not end in a write"
    kv.release.set()
    meta.wait_ticket(short, patient=True)
    assert meta.group.settled >= long
    assert kv.writes == base + 1, "the two were not one KV write"
    assert kv.get(K.dentry_key(ROOT_INO, b"applied")) is not None
