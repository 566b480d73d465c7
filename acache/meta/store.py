"""MetaStore: the namespace and the journal, one interface over a KV.

The whole namespace is mirrored in memory (checkpoint trees are thousands of
files, not billions) and written through to the KV in atomic batches; hot
data-path calls (read/write) touch no key.  A second implementation (a remote
head, FoundationDB...) replaces this class without the VFS noticing.

Write-back states of a file (the durability rule of each):
  dirty       open for writing, or closed with a journaled PUT not yet started.
              Bytes are in the cache file; the `dirty` flag is in the KV, so a
              crash re-journals the file at restart.  fsync = fdatasync + sync batch.
  persisting  its PUT is being staged/committed to the under-storage.
  persisted   the under-storage holds its current content at `upath`.
  failed      the under-storage refused it permanently; retried, data kept.
  unacknowledged  open for writing at a crash and never fsynced since: what it holds
              was never acknowledged, so it is kept in the cache (`local` says why)
              and not published until it is closed again (VFS._recover_dirty).

A failed write (the KV refused a batch: a full disk, an I/O error) leaves memory as the KV
has it: the VFS and the journal rules change Inode/Entry objects in place while they build
a Txn, so instead of recording pre-images at every mutation (easy to miss one), a failed
commit restores the whole in-memory state from the KV -- the durable truth, since a batch
is atomic -- *in place*: existing Inode and Entry objects get their stored fields back (so
references held by handles and persister jobs stay valid), objects the KV does not have are
dropped, missing ones re-added, dentries and the journal's indexes rebuilt.  Then the commit
raises MetaError (EIO at the mount).  O(namespace), but only on a failure.  The monotonic
counters (next_ino, next_seq) are not rolled back: a gap is harmless, a reused number is not.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import os
import stat as st
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Callable, Iterator, Protocol

import msgpack

from acache.errors import ConfigError, MetaError
from acache.meta import schema as K
from acache.meta.kv import KV

ROOT_INO = 1
PATH_CHANGES = ("rename", "delete", "rmdir", "mkdir")   # ops that move or remove what is at
                                                        # a path (MetaStore.path_changes)
_NAMES = "surrogateescape"   # paths are str decoded with surrogateescape: any bytes
log = logging.getLogger("acache.meta")


class Owner(Protocol):
    """The layer that owns the cache files the journal refers to (one host's VFS, the cluster
    head's namespace), handed once with :meth:`MetaStore.attach`."""

    def gc_gen(self, ino: int, gen: int) -> None:
        """A committed batch let go of generation ``gen``: its cache file may go."""


class _NoOwner:
    def gc_gen(self, ino: int, gen: int) -> None:
        pass


class MissingInode(KeyError):
    """A path was asked of an inode that is missing, or that sits below a missing one."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "missing inode"


def _known(cls, d: dict) -> dict:
    """A stored record's fields, refusing ones this version does not know: a record of a
    newer acache (a downgrade) may carry a rule this one would break by ignoring it."""
    unknown = set(d) - {f.name for f in fields(cls)}
    if unknown:
        raise ConfigError(f"the metadata holds {cls.__name__.lower()} records with fields this "
                          f"version of acache does not know ({', '.join(sorted(unknown))}): it "
                          "was written by a newer version; run that version")
    return d


def _pack(obj, names: tuple[str, ...]) -> bytes:
    """A flat dataclass as a msgpack map (what asdict gives, without its deep copy: 5x
    faster, and every namespace operation packs a few)."""
    return msgpack.packb({n: getattr(obj, n) for n in names}, use_bin_type=True,
                         unicode_errors=_NAMES)


@dataclass
class Inode:
    ino: int
    mode: int
    uid: int = 0
    gid: int = 0
    nlink: int = 1
    size: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    parent: int = 0
    name: bytes = b""
    gen: int = 0              # data generation: cache file "<ino>.<gen>"
    dirty: bool = False       # open for writing since the last journaled PUT
    cached: bool = False      # the cache file of `gen` holds the whole content
    upath: str | None = None  # where the under-storage holds its committed data
    listed: bool = False      # dirs: under-storage children merged in
    node: str = "local"       # placement: the worker holding the cache file
    target: bytes = b""       # symbolic links: the target (data, never followed)
    synced: int = -1          # size acknowledged by the last fsync while open for writing
                              # (-1: none since the last close); recovery checks against it
    local: str = ""           # why the cache holds content that is not journaled (a crash
                              # while open for writing, never fsynced): kept, never evicted,
                              # never published until the file is closed again

    @property
    def is_dir(self) -> bool:
        return st.S_ISDIR(self.mode)

    def pack(self) -> bytes:
        return _pack(self, _INODE_FIELDS)

    @classmethod
    def unpack(cls, raw: bytes) -> "Inode":
        return cls(**_known(cls, msgpack.unpackb(raw, raw=False, unicode_errors=_NAMES)))


@dataclass
class Entry:
    """One operation to apply to the under-storage, in seq order.

    op: put (ino/gen/size -> path), rename (path -> dst, inos whose upath moves),
        delete (path), mkdir (path), rmdir (path), symlink (path -> target),
        attrs (path: only the attributes of what is there changed).
    put/mkdir/symlink/attrs land with the inode's attributes as they are when the
    entry starts (recorded in ``attrs`` then), so attribute changes before that
    collapse into it (journal.on_attrs)."""
    seq: int
    op: str
    path: str
    dst: str = ""
    ino: int = 0
    gen: int = 0
    size: int = 0
    t: float = 0.0            # when it was journaled, on MetaStore.clock (flush delay counts
                              # from here): in memory only, never stored (a process-local
                              # clock means nothing after a restart or a reboot)
    token: str = ""           # a stage in progress (cleaned up after a crash)
    inos: list = field(default_factory=list)
    replaces: bool = False    # put/mkdir landing on the object of a file/dir it replaced by
                              # rename: cancelling it must delete that object (journal.py)
    hold: bool = False        # put of a file reopened for writing in place: it keeps its
                              # place but waits for the next close (journal.hold_put)
    target: str = ""          # symlink: the link's target
    attrs: list = field(default_factory=list)   # Attrs.pack() taken when it started
    node: str = ""            # put, in a cluster: the node holding its bytes (acache.cluster)
    # put: every entry up to this seq must have landed before this one commits -- those
    # journaled before the operation that journaled it began (MetaStore.op); PUTs journaled
    # by operations that overlapped in time may commit in parallel (DESIGN.md point 4:
    # order = happens-before).  -1: all before it (an operation that did not say)
    after: int = -1

    def pack(self) -> bytes:
        return _pack(self, _ENTRY_FIELDS)

    @classmethod
    def unpack(cls, raw: bytes, t: float = 0.0) -> "Entry":
        d = msgpack.unpackb(raw, raw=False, unicode_errors=_NAMES)
        d["t"] = t                # records of older versions stored one: ignored
        return cls(**_known(cls, d))

    def touches(self, prefix: str) -> bool:
        """Does this entry change anything at or under ``prefix`` ('' = all)?"""
        if not prefix:
            return True
        return any(p == prefix or p.startswith(prefix + "/") for p in (self.path, self.dst) if p)


_INODE_FIELDS = tuple(f.name for f in fields(Inode))
_ENTRY_FIELDS = tuple(f.name for f in fields(Entry) if f.name != "t")   # t: memory only


def _seq(e: "Entry") -> int:
    return e.seq


def _drop(index: dict[int, set[int]], key: int, seq: int) -> None:
    seqs = index.get(key)
    if seqs is not None:
        seqs.discard(seq)
        if not seqs:
            del index[key]


class Txn:
    """Changes collected under the store lock and written as one batch."""

    def __init__(self, store: "MetaStore") -> None:
        self.store = store
        self.ticket = 0                          # GroupCommit: the batch's, once committed
        self._open = True
        store._begun += 1                        # see MetaStore.after_failure
        self.puts: dict[bytes, bytes] = {}
        self.deletes: list[bytes] = []
        self.dirty_inodes: dict[int, Inode] = {}
        self.freed: list[tuple[int, int]] = []   # (ino, gen) no longer needed by the journal
        self.dropped: list = []                  # Inodes/Entries taken out of memory: put back
                                                 # (the same objects) if the commit fails
        self.succ: list[tuple[int, int]] = []    # (cancelled seq, the seq that carries it on)

    def save(self, ino: Inode) -> None:
        self.dirty_inodes[ino.ino] = ino

    def link(self, parent: int, name: bytes, ino: int) -> None:
        self.store._children.setdefault(parent, {})[name] = ino
        self.puts[K.dentry_key(parent, name)] = K.u64(ino)
        self.deletes = [k for k in self.deletes if k != K.dentry_key(parent, name)]

    def unlink(self, parent: int, name: bytes) -> None:
        self.store._children.get(parent, {}).pop(name, None)
        key = K.dentry_key(parent, name)
        self.puts.pop(key, None)
        self.deletes.append(key)

    def drop_inode(self, ino: int) -> None:
        node = self.store._inodes.pop(ino, None)
        if node is not None:
            self.dropped.append(node)
        self.store._children.pop(ino, None)
        self.dirty_inodes.pop(ino, None)
        self.puts.pop(K.inode_key(ino), None)
        self.deletes.append(K.inode_key(ino))

    def append(self, **kw) -> Entry:
        s = self.store
        s._next_seq += 1
        floor = getattr(s._op, "floor", None)
        if floor is not None and kw.get("op") == "put":
            kw["after"] = min(floor, s._next_seq - 1)
        if not getattr(s._op, "told", False):
            s._serial_top = s._next_seq     # an engine's floor (op) never goes below it
        e = Entry(seq=s._next_seq, t=s.clock(), **kw)
        s._mine.seq = e.seq                 # see journaled()
        s._journal[e.seq] = e
        log.debug("journal +%d %s %s%s (ino %d gen %d, after %d)", e.seq, e.op, e.path,
                  f" -> {e.dst}" if e.dst else "", e.ino, e.gen, e.after)
        s._index(e)
        self.puts[K.journal_key(e.seq)] = e.pack()
        self.puts[K.counter_key("next_seq")] = K.u64(s._next_seq)
        return e

    def succeeds(self, old_seq: int, new: Entry) -> None:
        """``new`` carries on what the cancelled entry ``old_seq`` would have landed (the
        same bytes under a new name, or newer content that includes them): a barrier
        waiting for ``old_seq`` waits for ``new`` instead (MetaStore.successor)."""
        self.succ.append((old_seq, new.seq))

    def update_entry(self, e: Entry) -> None:
        self.puts[K.journal_key(e.seq)] = e.pack()

    def remove_entry(self, seq: int) -> None:
        e = self.store._journal.pop(seq, None)
        log.debug("journal -%d", seq)
        if e is not None:
            self.dropped.append(e)
            self.store._unindex(e)
        self.puts.pop(K.journal_key(seq), None)
        self.deletes.append(K.journal_key(seq))
        if e is not None and e.token:   # a stage may have left something behind
            self.orphan_stage(e.token)

    def orphan_stage(self, token: str) -> None:
        """No entry holds ``token`` any more: remember it until its leftovers are gone."""
        self.puts[K.stage_key(token)] = b""

    def record_skip(self, e: Entry, reason: str) -> None:
        """The operator gave up entry ``e`` (kept as a record, not in the journal)."""
        self.puts[K.skipped_key(e.seq)] = msgpack.packb(
            {"op": e.op, "path": e.path, "dst": e.dst, "reason": reason, "time": time.time()},
            use_bin_type=True, unicode_errors=_NAMES)

    def put_raw(self, key: bytes, value: bytes) -> None:
        """A record of another module's schema (acache.cluster.sessions), in this batch."""
        self.deletes = [k for k in self.deletes if k != key]
        self.puts[key] = value

    def delete_raw(self, key: bytes) -> None:
        self.puts.pop(key, None)
        self.deletes.append(key)

    def forget_stage(self, token: str) -> None:
        """``token``'s stage was committed or cleaned up."""
        key = K.stage_key(token)
        self.puts.pop(key, None)
        self.deletes.append(key)

    def commit(self, sync: bool = False, lazy: bool = False, linger: float = 0.0) -> None:
        """Write the batch (GroupCommit: queue it).  ``lazy``, ``linger``: GroupCommit.submit."""
        if self._open:
            self._open = False
            self.store._ended += 1
        for ino in self.dirty_inodes.values():
            if ino.ino in self.store._inodes:
                self.puts[K.inode_key(ino.ino)] = ino.pack()
        if self.store.group is not None:
            self._commit_grouped(sync, lazy and not sync, linger)
            return
        if self.puts or self.deletes or self.store.stale:
            try:
                if self.store.stale:    # built on memory an earlier failure left ahead of the KV
                    raise MetaError("an earlier metadata write could not be undone yet")
                self.store.kv.write(self.puts, self.deletes, sync=sync)
            except Exception as e:
                dropped = self.dropped
                self.puts, self.deletes, self.dirty_inodes, self.freed, self.dropped = {}, [], {}, [], []
                self.succ = []
                self.store.undo(e, dropped)
                raise MetaError(f"metadata write failed: {e}") from None
        freed, self.freed = self.freed, []
        if self.succ and self.store.barriers:
            self.store._succ.update(self.succ)
        self.puts, self.deletes, self.dirty_inodes, self.dropped, self.succ = {}, [], {}, [], []
        for freed_ino, gen in freed:
            self.store.on_freed(freed_ino, gen)

    def _commit_grouped(self, sync: bool, lazy: bool = False, linger: float = 0.0) -> None:
        """Queue the batch (GroupCommit); ``sync``: and wait until it landed (under the lock:
        an fsync's record, a recovery's).  ``self.ticket``: what an acknowledgement waits for."""
        s = self.store
        g = s.group
        assert g is not None
        puts, deletes, dropped, freed, succ = self.puts, self.deletes, self.dropped, self.freed, self.succ
        self.puts, self.deletes, self.dirty_inodes, self.dropped, self.freed, self.succ = {}, [], {}, [], [], []
        after = [functools.partial(s.on_freed, ino, gen) for ino, gen in freed]
        if not (puts or deletes or s.stale or g.broken is not None):
            for fn in after:
                if not g.after_durable(fn):
                    fn()
            return
        try:
            if s.stale:
                raise MetaError("an earlier metadata write could not be undone yet")
            self.ticket = g.submit(puts, deletes, dropped, after, lazy, linger)
            if not getattr(s._mine, "first", 0):
                s._mine.first = self.ticket
            s._mine.last = self.ticket
        except MetaError as e:
            s.heal(e, dropped)
            raise MetaError(f"metadata write failed: {e}") from None
        if succ and s.barriers:
            s._succ.update(succ)
        if sync:
            try:
                g.wait(self.ticket)
            except MetaError:
                s.heal(None)
                raise


class _Batch:
    __slots__ = ("ticket", "puts", "deletes", "dropped", "after", "held", "taken", "linger", "owner")

    def __init__(self, ticket: int, puts: dict, deletes: list, dropped: list, after: list) -> None:
        self.ticket, self.puts, self.deletes, self.dropped, self.after = ticket, puts, deletes, dropped, after
        self.held = 0.0           # a hold (GroupCommit.hold) keeps it queued until then
        self.taken = False        # the writer took it (too late to add to it)
        self.linger = 0.0         # a lazy batch waits for company until then (submit)
        self.owner = 0            # the thread that submitted a lazy batch


class _Hold:
    __slots__ = ("batches", "until")

    def __init__(self) -> None:
        self.batches: list[_Batch] = []
        self.until = 0.0


class GroupCommit:
    """Write-behind of a MetaStore's batches, for a KV whose write is a slow round trip (etcd:
    a txn waits for the members' WAL fsync, ~1-5 ms, however small).

    Why.  A MetaStore's changes are made under its one lock; writing each batch under that lock
    too makes the KV's latency the limit of everything (the cluster head's namespace and its
    persister together made ~200 writes/s).  Here a commit under the lock only queues its batch
    and gets a *ticket*; one writer thread writes the queue in order, several batches merged
    into one KV write (a group: all-or-nothing, as one batch is), while the lock is free for the
    next operations.  Whoever acknowledges something waits for its ticket first, outside the
    lock (:meth:`wait`): the cluster head before it replies to any namespace call, the persister
    before it sends a byte under a stage it recorded.

    Memory runs ahead of the KV by the queue.  So a failed group fails every batch queued
    behind it too (each was built on memory that had the failed changes), and the store's memory
    is brought back to the KV's state (MetaStore.heal) before any new batch is taken: until
    then the pipeline is *broken* and ``submit`` refuses.  Tickets settle in order; a ticket's
    failure is remembered (the last few ranges) so a late waiter still hears of it.

    Callbacks that must not run before their batch is durable (a cache file the journal let go
    of, an applied entry's cleanup) are attached to the newest batch and run once it has
    landed, in order, on a helper thread that takes the store's lock: never on the writer, which
    must not wait for that lock (a sync commit holds it while it waits for the writer).
    """

    GROUP_OPS = 110             # a group fits one etcd txn (kv_etcd.TXN_OPS is 120)
    GROUP_BYTES = 512 * 1024
    HOLD_MAX = 0.1              # the longest a hold keeps the writer from a batch (hold)
    LINGER = 0.002              # the longest a lazy batch waits for company (submit)

    def __init__(self, kv: KV, lock: threading.RLock, on_broken: Callable[[BaseException], None]) -> None:
        self.kv = kv
        self.cv = threading.Condition()
        self._store_lock = lock
        self._on_broken = on_broken
        self.queue: list[_Batch] = []
        self.issued = 0             # the newest ticket handed out
        self.firm = 0               # ... of a batch that is not lazy (submit)
        self.settled = 0            # every ticket up to here landed or failed
        self.broken: BaseException | None = None
        self.dropped: list = []     # objects failed batches took out of memory (for heal)
        self.failures: list[tuple[int, int, str]] = []   # (first, last ticket, why), newest last
        self.writes = 0             # KV writes made (groups), for tests and status
        self._inflight: list | None = None   # callbacks attached while a group is written
        self._stop = False
        self._after: list[list[Callable[[], None]]] = []
        self._after_cv = threading.Condition()
        self._holds: dict[int, _Hold] = {}      # thread ident -> its hold (see hold)
        self._writer = threading.Thread(target=self._run, name="acache-meta-commit", daemon=True)
        self._helper = threading.Thread(target=self._run_after, name="acache-meta-after", daemon=True)
        self._writer.start()
        self._helper.start()

    # -- the store's side (under its lock) ----------------------------------------------
    def submit(self, puts: dict, deletes: list, dropped: list, after: list,
               lazy: bool = False, linger: float = 0.0) -> int:
        """Queue a batch; its ticket.  ``lazy``: nobody waits for it but its submitter, who
        does not hurry (a cluster head's end of a write or read session, which a RELEASE asked
        for after close(2) had returned; the persister's record of a stage begun and of an
        entry applied): it waits up to ``linger`` (default LINGER) for the next batch, or
        goes with one written now, so that they share one KV write (on etcd, a file's create
        with the previous file's release and landing: 2.9 fsynced round trips per small file
        on a head instead of 3.6).  The next batch that is not lazy,
        or anyone else's wait for it, sends it at once; an operation that changed nothing does
        not wait for lazy batches behind the newest other one (``firm``: they end sessions, which
        no reply reports)."""
        with self.cv:
            if self.broken is not None:
                raise MetaError(f"an earlier metadata write failed ({self.broken}); undoing it")
            if self._stop:
                raise MetaError("the metadata store is closed")
            self.issued += 1
            b = _Batch(self.issued, puts, deletes, dropped, after)
            if lazy:
                b.linger = time.monotonic() + (linger or self.LINGER)
                b.owner = threading.get_ident()
            else:
                self.firm = self.issued
                self._unlinger(self.issued)
            h = self._holds.get(threading.get_ident())
            if h is not None:
                if not h.until:
                    h.until = time.monotonic() + self.HOLD_MAX
                b.held = h.until
                h.batches.append(b)
            self.queue.append(b)
            self.cv.notify_all()
            return self.issued

    # -- holding a request's batches back, so its reply lands with them ------------------
    def hold(self) -> None:
        """From now on, the batches this thread submits stay queued -- and so does every
        batch behind them: the order is kept -- until :meth:`release`, for at most HOLD_MAX
        seconds after the first of them.  So what the caller adds at release (a request's
        reply: acache.cluster.requests) lands in the same KV write as its effects."""
        with self.cv:
            self._holds[threading.get_ident()] = _Hold()

    def release(self, puts: dict | None = None, deletes: list | None = None) -> bool:
        """End this thread's hold; add ``puts``/``deletes`` to the last batch it submitted
        if that is still queued.  False if they were not added (no batch, or the hold ran
        out and the batch was taken): the caller writes them in a batch of their own."""
        with self.cv:
            h = self._holds.pop(threading.get_ident(), None)
            if h is None:
                return False
            added = False
            if h.batches and not h.batches[-1].taken and (puts or deletes):
                last = h.batches[-1]
                last.deletes.extend(deletes or ())
                last.puts.update(puts or {})
                added = True
            for b in h.batches:
                b.held = 0.0
            self.cv.notify_all()
            return added

    def _unlinger(self, upto: int, but: int = 0) -> None:
        """Lazy batches up to ticket ``upto`` go with the next write (cv held); ``but``:
        except this thread's."""
        for q in self.queue:
            if q.ticket > upto:
                break
            if q.linger and q.owner != but:
                q.linger = 0.0
                self.cv.notify_all()

    def _unhold_self(self) -> None:
        """This thread waits for its own batches: a hold of its own would only delay it."""
        if threading.get_ident() in self._holds:
            self.release()

    def after_durable(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` once everything submitted so far has landed (dropped if it fails).
        False: nothing is pending -- the caller runs it now."""
        if threading.current_thread() is self._helper:
            return False            # from a callback: what triggered it has landed
        with self.cv:
            if self.queue:
                self.queue[-1].after.append(fn)
            elif self._inflight is not None:
                self._inflight.append(fn)
            else:
                return False
            return True

    def take_dropped(self) -> list:
        with self.cv:
            out, self.dropped = self.dropped, []
            return out

    def reset(self) -> None:
        with self.cv:
            self.broken = None
            self.cv.notify_all()

    # -- anyone's side ---------------------------------------------------------------------
    def wait(self, ticket: int, since: int = -1, patient: bool = False) -> None:
        """Until ``ticket`` has settled; MetaError if a ticket in (``since``, ``ticket``] failed
        (``since`` defaults to ``ticket - 1``: just that one).  Lazy batches up to ``ticket``
        are sent at once, unless ``patient`` (a background waiter, the persister's stager:
        they keep waiting up to LINGER for company) or they are this thread's own."""
        if ticket <= 0:
            return
        self._unhold_self()
        lo = ticket - 1 if since < 0 else since
        with self.cv:
            if self.settled < ticket and not patient:
                self._unlinger(ticket, but=threading.get_ident())
            while self.settled < ticket:
                self.cv.wait()
            for first, last, why in reversed(self.failures):
                if last <= lo:
                    break
                if first <= ticket:
                    raise MetaError(f"metadata write failed: {why}")

    def drain(self) -> None:
        """Until everything submitted has settled (no error raised: see ``wait``)."""
        self._unhold_self()
        with self.cv:
            self._unlinger(self.issued)
            while self.settled < self.issued:
                self.cv.wait()

    def close(self, timeout: float = 10.0) -> None:
        with self.cv:
            self._stop = True
            self.cv.notify_all()
        self._writer.join(timeout)
        with self.cv:                # still queued (a KV that never answered): failed
            if self.queue and not self._writer.is_alive():
                left, self.queue = self.queue, []
                self.failures.append((left[0].ticket, left[-1].ticket, "the metadata store closed"))
                self.settled = left[-1].ticket
                self.cv.notify_all()
        with self._after_cv:
            self._after_cv.notify_all()
        self._helper.join(timeout)

    # -- the writer ------------------------------------------------------------------------
    def _take(self) -> list[_Batch]:
        group: list[_Batch] = []
        ops, size = 0, 0
        now = time.monotonic()
        while self.queue:
            b = self.queue[0]
            if b.held > now and not self._stop:
                break          # held back (hold), and everything behind it; a lingering lazy
                               # batch goes with the write _next_due said is due
            n = len(b.puts) + len(b.deletes)
            m = sum(len(k) + len(v) for k, v in b.puts.items()) + sum(map(len, b.deletes))
            if group and (ops + n > self.GROUP_OPS or size + m > self.GROUP_BYTES):
                break
            b.taken = True
            group.append(self.queue.pop(0))
            ops, size = ops + n, size + m
        return group

    def _next_due(self, now: float) -> float:
        """When the writer may write next (cv held, queue not empty): the first time a batch
        it may take -- one before any batch held back -- is due, lazy batches waiting for
        company until their linger ends; what waits for a hold, that hold's end."""
        at = math.inf
        for b in self.queue:
            if b.held > now:
                return min(at, b.held)
            at = min(at, b.linger)
            if at <= now:
                break
        return at

    def _run(self) -> None:
        while True:
            with self.cv:
                while True:
                    if not self.queue:
                        if self._stop:
                            return
                        self.cv.wait()
                        continue
                    now = time.monotonic()
                    wait = self._next_due(now) - now
                    if wait <= 0 or self._stop:
                        break
                    self.cv.wait(wait)       # a hold or a linger: until it ends or runs out
                group = self._take()         # not empty: _next_due stops at a hold
                self._inflight = []
            ops: dict[bytes, bytes | None] = {}
            for b in group:                  # in order: a later batch's put or delete wins
                for k in b.deletes:
                    ops[k] = None
                ops.update(b.puts)
            err: BaseException | None = None
            try:
                self.kv.write({k: v for k, v in ops.items() if v is not None},
                              [k for k, v in ops.items() if v is None], sync=True)
            except Exception as e:
                err = e
            with self.cv:
                self.writes += 1
                after = [fn for b in group for fn in b.after] + (self._inflight or [])
                self._inflight = None
                if err is None:
                    self.settled = group[-1].ticket
                else:
                    failed, self.queue = group + self.queue, []
                    self.failures = self.failures[-63:] + [(failed[0].ticket, failed[-1].ticket, str(err))]
                    self.settled = failed[-1].ticket
                    self.dropped.extend(o for b in failed for o in b.dropped)
                    self.broken = err
                self.cv.notify_all()
            if err is not None:
                log.error("metadata write of %d batch(es) failed: %s", len(group), err)
                try:
                    self._on_broken(err)
                except Exception:
                    log.exception("undoing a failed metadata write")
            elif after:
                with self._after_cv:
                    self._after.append(after)
                    self._after_cv.notify_all()

    def _run_after(self) -> None:
        while True:
            with self._after_cv:
                while not self._after and not (self._stop and not self._writer.is_alive()):
                    self._after_cv.wait(0.5)
                if not self._after:
                    return
                todo, self._after = self._after, []
            with self._store_lock:
                for fns in todo:
                    for fn in fns:
                        try:
                            fn()
                        except Exception:
                            log.exception("after a metadata write")


class MetaStore:
    """The namespace + journal.  Callers hold ``lock`` around reads and txns."""

    def __init__(self, kv: KV, clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        # when entries were journaled, for the flush delay (the persister uses this clock
        # too); entries found at start count as journaled now: eligible after flush_delay
        self.clock = clock
        self.lock = threading.RLock()
        self._op = threading.local()                # .floor, .told: see op()
        self._mine = threading.local()              # .first, .last: GroupCommit tickets of
                                                    # this thread's operation (mark())
        self._serial_top = 0       # the newest entry journaled without an engine's floor
                                   # (set to next_seq below: all before a start returned)
        self._inodes: dict[int, Inode] = {}
        self._children: dict[int, dict[bytes, int]] = {}
        self._journal: dict[int, Entry] = {}
        # indexes of the journal, so that no namespace call scans it (rmtree of N pending
        # files would cost N x pending): ino -> seqs
        # entries about the inode itself (e.ino), by op, each in seq order: entries_of(ino,
        # op) costs what it returns, not the inode's whole history (a file renamed round and
        # round has thousands of RENAMEs pending while the PUT is asked for at every rename)
        self._of_ino: dict[int, dict[str, dict[int, Entry]]] = {}
        self._moves_of: dict[int, set[int]] = {}  # pending RENAMEs moving it (or a dir above)
        # seq -> entry, in seq order: the PUTs, and the entries that change a path (what the
        # persister's scheduler looks at, so that it never walks the whole head of the journal)
        self._puts: dict[int, Entry] = {}
        self._path_changes: dict[int, Entry] = {}
        self.owner: Owner = _NoOwner()              # told of cache files the journal let go of
        self.stale = False                          # memory may be ahead of the KV (undo failed)
        self._begun = self._ended = 0               # Txns made / committed (after_failure)
        # Barriers (flush --wait) in progress, and while there are any, which cancelled
        # entry another carries on (Txn.succeeds): in memory only, as a barrier is
        self.barriers = 0
        self._succ: dict[int, int] = {}
        raw = kv.get(K.counter_key("next_ino"))
        self._next_ino = K.from_u64(raw) if raw else ROOT_INO
        raw = kv.get(K.counter_key("next_seq"))
        self._next_seq = K.from_u64(raw) if raw else 0
        self._serial_top = self._next_seq
        for _, v in kv.scan(K.INODE_PREFIX):
            ino = Inode.unpack(v)
            self._inodes[ino.ino] = ino
        for k, v in kv.scan(K.DENTRY_PREFIX):
            parent = K.from_u64(k[1:9])
            self._children.setdefault(parent, {})[k[9:]] = K.from_u64(v)
        for _, v in kv.scan(K.JOURNAL_PREFIX):
            e = Entry.unpack(v, t=clock())
            self._journal[e.seq] = e
            self._index(e)
        if ROOT_INO not in self._inodes:
            now = time.time_ns()
            # the node's user owns the root: root's node as before, a normal user's node
            # (pyfuse3 through fusermount3) lets its user write there
            root = Inode(ROOT_INO, st.S_IFDIR | 0o755, nlink=2, atime_ns=now, mtime_ns=now,
                         ctime_ns=now, upath="", cached=True, uid=os.geteuid(), gid=os.getegid())
            self._inodes[ROOT_INO] = root
            kv.write({K.inode_key(ROOT_INO): root.pack(),
                      K.counter_key("next_ino"): K.u64(ROOT_INO)}, sync=True)
        # a KV whose every write is a slow round trip (etcd) is written behind, in groups
        self.group: GroupCommit | None = \
            GroupCommit(kv, self.lock, self.heal) if getattr(kv, "group_commit", False) else None

    # -- the journal's indexes ---------------------------------------------------
    def _index(self, e: Entry) -> None:
        """Called in seq order (appends; loading and restoring walk the journal in order),
        so the ordered indexes stay in seq order."""
        self._of_ino.setdefault(e.ino, {}).setdefault(e.op, {})[e.seq] = e
        for ino in e.inos if e.op == "rename" else ():
            self._moves_of.setdefault(ino, set()).add(e.seq)
        if e.op == "put":
            self._puts[e.seq] = e
        elif e.op in PATH_CHANGES:
            self._path_changes[e.seq] = e

    def _unindex(self, e: Entry) -> None:
        by_op = self._of_ino.get(e.ino)
        if by_op is not None:
            seqs = by_op.get(e.op)
            if seqs is not None:
                seqs.pop(e.seq, None)
                if not seqs:
                    del by_op[e.op]
                    if not by_op:
                        del self._of_ino[e.ino]
        for ino in e.inos if e.op == "rename" else ():
            _drop(self._moves_of, ino, e.seq)
        self._puts.pop(e.seq, None)
        self._path_changes.pop(e.seq, None)

    # -- reads -------------------------------------------------------------------
    def attach(self, owner: Owner) -> None:
        """The layer that owns the cache files (built after the store: it needs it)."""
        if not isinstance(self.owner, _NoOwner):
            raise RuntimeError("the metadata store's cache files have an owner already")
        self.owner = owner

    def on_freed(self, ino: int, gen: int) -> None:
        self.owner.gc_gen(ino, gen)

    def txn(self) -> Txn:
        return Txn(self)

    def get(self, ino: int) -> Inode | None:
        return self._inodes.get(ino)

    def child(self, parent: int, name: bytes) -> int | None:
        return self._children.get(parent, {}).get(name)

    def children(self, parent: int) -> dict[bytes, int]:
        return self._children.get(parent, {})

    def parents(self) -> list[int]:
        """The inodes that have directory entries (as the dentries say)."""
        return list(self._children)

    def inodes(self) -> Iterator[Inode]:
        return iter(list(self._inodes.values()))

    def path_of(self, ino: int) -> str:
        """The under-storage path ('' for the root) of an inode's current name."""
        parts, start = [], ino
        while ino != ROOT_INO:
            node = self._inodes.get(ino)
            if node is None:
                raise MissingInode(f"inode {start} has no path: inode {ino}"
                                   f"{' above it' if ino != start else ''} is missing from the "
                                   "metadata")
            parts.append(node.name.decode("utf-8", "surrogateescape"))
            ino = node.parent
        return "/".join(reversed(parts))

    def journal(self) -> list[Entry]:
        """A copy of the whole journal, oldest first: O(pending), not for per-file paths."""
        return list(self._journal.values())     # appended in seq order, loaded in key order

    def head(self, n: int) -> list[Entry]:
        """The ``n`` oldest entries."""
        return list(itertools.islice(self._journal.values(), n))

    def pending_puts(self) -> Iterator[Entry]:
        """The PUT entries, oldest first, lazily (do not change the journal while iterating)."""
        return iter(self._puts.values())

    def path_changes(self) -> Iterator[Entry]:
        """The entries whose op is in PATH_CHANGES, oldest first, lazily (as pending_puts)."""
        return iter(self._path_changes.values())

    def newest(self) -> Iterator[Entry]:
        """The entries newest first, lazily (do not change the journal while iterating)."""
        return reversed(self._journal.values())

    def entries_of(self, ino: int, *ops: str) -> list[Entry]:
        """Pending entries about ``ino`` itself (``e.ino``), oldest first; only ``ops`` if given."""
        by_op = self._of_ino.get(ino)
        if not by_op:
            return []
        groups = [g for g in (by_op.values() if not ops else map(by_op.get, ops)) if g]
        if len(groups) == 1:
            return list(groups[0].values())
        return sorted((e for g in groups for e in g.values()), key=_seq)

    def entry(self, seq: int) -> Entry | None:
        return self._journal.get(seq)

    def orphan_stages(self) -> list[str]:
        """Stage tokens no entry holds, whose leftovers may still exist (schema: T)."""
        if self.group is not None:
            self.group.drain()
        return [k[1:].decode("utf-8", "surrogateescape") for k, _ in self.kv.scan(K.STAGE_PREFIX)]

    def puts_of(self, ino: int) -> list[Entry]:
        return self.entries_of(ino, "put")

    def moves_of(self, ino: int) -> list[Entry]:
        """Pending RENAMEs that move this inode (itself or a directory above it) in the
        under-storage: until they land, it is not there under its current name."""
        return [self._journal[s] for s in sorted(self._moves_of.get(ino, ()))]

    def gen_pending(self, ino: int, gen: int) -> bool:
        return any(e.gen == gen for e in self.puts_of(ino))

    @contextlib.contextmanager
    def op(self, floor: int | None = None) -> Iterator[None]:
        """Around a namespace operation a caller sees return (a close), entered *before*
        it waits for the lock: the PUT it journals need land only after the entries
        journaled before it began -- everything whose operation had returned by then
        (each journals before it returns).  Operations that overlap, such as the ranks
        of a checkpoint closing their shards at the same moment, commit in parallel.
        ``floor``: what the caller found had returned before the operation began
        (acache.fs.overlap); entries journaled otherwise count in full."""
        outer = getattr(self._op, "floor", None)
        if outer is None:
            if floor is None:
                self._op.floor = self._next_seq    # one int read: no lock needed
            else:       # the engine knows better which closes this one overlapped
                self._op.floor = min(max(floor, self._serial_top), self._next_seq)
                self._op.told = True
        try:
            yield
        finally:
            if outer is None:
                self._op.floor = None
                self._op.told = False

    def begin_barrier(self) -> None:
        with self.lock:
            self.barriers += 1

    def end_barrier(self) -> None:
        with self.lock:
            self.barriers -= 1
            if not self.barriers:
                self._succ.clear()

    def successor(self, seq: int) -> Entry | None:
        """The pending entry that carries on the cancelled entry ``seq`` (following
        renames of renames), if a barrier was running when it was cancelled."""
        while (nxt := self._succ.get(seq)) is not None:
            e = self._journal.get(nxt)
            if e is not None:
                return e
            seq = nxt
        return None

    def newest_seq(self) -> int:
        """The seq of the newest entry still in the journal (0 if empty)."""
        return next(reversed(self._journal), 0)

    def journal_len(self) -> int:
        return len(self._journal)

    def last_seq(self) -> int:
        return self._next_seq

    def last_ino(self) -> int:
        """The highest inode number ever allocated (as far as the KV recorded)."""
        return self._next_ino

    # -- allocation --------------------------------------------------------------
    def new_inode(self, txn: Txn, **kw) -> Inode:
        self._next_ino += 1
        ino = Inode(ino=self._next_ino, **kw)
        self._inodes[ino.ino] = ino
        txn.puts[K.counter_key("next_ino")] = K.u64(self._next_ino)
        txn.save(ino)
        return ino

    def sync(self) -> None:
        """Make every change so far durable against a host crash (fsync of the WAL)."""
        if self.group is not None:       # every group write is durable: wait for the last
            last = self.group.issued
            self.group.wait(last)
            return
        try:
            self.kv.write({K.counter_key("sync"): b""}, sync=True)
        except Exception as e:
            raise MetaError(f"metadata sync failed: {e}") from None

    # -- written behind (GroupCommit) ----------------------------------------------
    def mark(self) -> int:
        """Where the KV stands now, before an operation (on this thread) that will be
        acknowledged: see wait_visible."""
        self._mine.first = self._mine.last = self._mine.seq = 0
        return self.group.settled if self.group is not None else 0

    def journaled(self) -> int:
        """The newest entry this thread journaled since its ``mark()`` (0: none)."""
        return getattr(self._mine, "seq", 0)

    def wait_visible(self, since: int) -> None:
        """Before acknowledging an operation that began at ``mark()``: wait until every
        change it made or could have seen has landed.  MetaError if one it made failed (it is
        undone); if it made none, if any it could have seen failed (what it read is undone),
        lazy batches at the end of the queue aside (GroupCommit.submit).  Nothing to wait for
        without GroupCommit (each commit wrote through)."""
        g = self.group
        if g is None:
            return
        first, last = getattr(self._mine, "first", 0), getattr(self._mine, "last", 0)
        if last:            # a later failure cannot touch it: its batches were queued first
            g.wait(last, first - 1)
        else:
            g.wait(g.firm, since)

    def hold(self) -> None:
        """GroupCommit.hold (nothing without GroupCommit: each commit writes through)."""
        if self.group is not None:
            self.group.hold()

    def release(self, puts: dict, deletes: list) -> bool:
        """GroupCommit.release: False -- the caller commits ``puts``/``deletes`` itself."""
        return self.group is not None and self.group.release(puts, deletes)

    def wait_ticket(self, ticket: int, patient: bool = False) -> None:
        """Until the batch of a Txn committed (Txn.ticket) landed; MetaError if it failed.
        ``patient``: GroupCommit.wait."""
        if self.group is not None:
            self.group.wait(ticket, patient=patient)

    def after_durable(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (under the lock) once the changes so far have landed: now without
        GroupCommit; never if they fail (memory is restored, and what ``fn`` would clean up
        is needed again)."""
        if self.group is None or not self.group.after_durable(fn):
            fn()

    def ready(self) -> None:
        """Before an operation (GroupCommit): if a failed write left memory ahead of the KV
        and it could not be read back then (the KV was unreachable), read it back now rather
        than fail the operation for what an earlier one did; MetaError if it still cannot be."""
        g = self.group
        if g is None or (g.broken is None and not self.stale):
            return
        self.heal(None)
        if self.stale:
            raise MetaError("an earlier metadata write failed and the store cannot be read back yet")

    def heal(self, err: BaseException | None, dropped=()) -> None:
        """GroupCommit: a group failed (``err``) -- memory is ahead of the KV by it and by
        every batch queued after it: restore memory from the KV, then take batches again."""
        g = self.group
        with self.lock:
            if g is None or (g.broken is None and not self.stale and not dropped):
                return
            g.drain()
            objs = list(dropped) + g.take_dropped()
            try:
                self.restore(objs)
                log.error("metadata write failed, the operations queued with it are undone "
                          "(EIO): %s", err or g.broken)
            except Exception as e2:
                self.stale = True
                log.error("metadata write failed (%s) and the store cannot be read back (%s): "
                          "every change fails (EIO) until it can", err or g.broken, e2)
            g.reset()

    # -- a failed write ------------------------------------------------------------
    def after_failure(self, err: BaseException) -> bool:
        """An operation ended with an unexpected error (an OSError of the cache disk, a
        bug): if it made a Txn and never committed it, it may have changed memory that
        the KV does not have -- bring memory back to the KV's state.  Called at the mount
        engines' error edge, without the lock held by the failed operation (every Txn is
        made and committed under the lock, so under it an uncommitted one is abandoned).
        Returns whether memory was restored."""
        with self.lock:
            if self._begun == self._ended:
                return False
            self._ended = self._begun
            try:
                self.restore()
            except Exception as e2:
                self.stale = True
                log.error("an operation failed before its metadata commit (%s) and the store "
                          "cannot be read back (%s): every change fails (EIO) until it can",
                          err, e2)
                return False
            log.error("an operation failed before its metadata commit (%s): its changes in "
                      "memory are undone", err)
            return True

    def undo(self, err: BaseException, dropped=()) -> None:
        """A batch failed (called under the lock): bring memory back to the KV's state;
        ``dropped``: objects the failed Txn took out of memory, reused if the KV has them."""
        try:
            self.restore(dropped)
            log.error("metadata write failed, the operation is undone (EIO): %s", err)
        except Exception as e2:
            self.stale = True
            log.error("metadata write failed (%s) and the store cannot be read back (%s): "
                      "every change fails (EIO) until it can", err, e2)

    def restore(self, dropped=()) -> None:
        """Make memory equal the KV again, in place (see the module docstring)."""
        if self.group is not None:
            self.group.drain()           # the KV as it will be: nothing in flight
        old_inodes = {o.ino: o for o in dropped if isinstance(o, Inode)}
        old_entries = {o.seq: o for o in dropped if isinstance(o, Entry)}
        with self.lock:
            inodes = {n.ino: n for n in (Inode.unpack(v) for _, v in self.kv.scan(K.INODE_PREFIX))}
            children: dict[int, dict[bytes, int]] = {}
            for k, v in self.kv.scan(K.DENTRY_PREFIX):
                children.setdefault(K.from_u64(k[1:9]), {})[k[9:]] = K.from_u64(v)
            entries = [Entry.unpack(v) for _, v in self.kv.scan(K.JOURNAL_PREFIX)]
            for ino in [i for i in self._inodes if i not in inodes]:
                del self._inodes[ino]
            for ino, stored in inodes.items():
                cur = self._inodes.get(ino) or old_inodes.get(ino)
                if cur is None:
                    self._inodes[ino] = stored
                else:
                    cur.__dict__.update(stored.__dict__)
                    self._inodes[ino] = cur
            self._children.clear()
            self._children.update(children)
            journal: dict[int, Entry] = {}
            for entry in entries:       # key order is seq order
                had = self._journal.get(entry.seq) or old_entries.get(entry.seq)
                if had is not None:
                    t = had.t               # in memory only: keep when it was journaled
                    had.__dict__.update(entry.__dict__)
                    had.t = t
                else:
                    entry.t = self.clock()
                journal[entry.seq] = had if had is not None else entry
            self._journal.clear()
            self._journal.update(journal)
            self._of_ino.clear()
            self._moves_of.clear()
            self._puts.clear()
            self._path_changes.clear()
            for e in journal.values():
                self._index(e)
            self.stale = False

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.kv.close()
