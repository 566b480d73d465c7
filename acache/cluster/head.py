"""The cluster's namespace head: one node at a time runs the namespace, the journal and the
persister for the whole cluster, over a MetaStore whose KV is etcd (acache.meta.kv_etcd).

Every node's mount (the head's own included) is a ClientVFS (acache.cluster.client): its
bytes stay in its own cache directory, and only namespace operations come here -- over the
peer transport from other nodes, as a plain call on the head itself.  Why one head rather
than every node mutating etcd directly: the journal's rules (journal.py) read and change
several records per operation (supersede a pending PUT, move it on rename, cancel it on
delete); done by one process under one lock they stay exactly the single-host rules, and the
journal's order is the order in which the head committed, which is real-time order across
hosts (DESIGN point 4 across hosts, with no watch-lag trap: no node orders by what its watch
has seen).  etcd makes the head's state survive it: a new head opens the same KV (fencing
off the old one) and carries on from what etcd holds.

Which node has which file open, for reading and for writing, the head keeps in memory and
writes in the batch of the operation that changed it (acache.cluster.sessions): a new head
loads it, a node that is gone has its sessions released by the head's reaper.  Opening for
writing on one node a file open for writing on another is EBUSY.  A file's bytes are on its *holder* (Inode.node), the node whose write
session made the current generation; the persister pulls them from there over the peer
transport into the head's cache before staging (``pull``), so what it uploads is what the
holder acknowledged.
"""
from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import asdict
from typing import Callable, Mapping

from acache.cluster import sessions as S
from acache.data.persister import Persister
from acache.data.readthrough import ReadThrough
from acache.errors import AcacheError, FsError
from acache.fs.overlap import Overlap
from acache.fs.namespace import Namespace
from acache.fs.types import Attr, Ctx
from acache.meta import journal
from acache.meta.store import Inode

log = logging.getLogger("acache.cluster.head")
# How long a write open waits for another node's RELEASE once that node closed every handle
# of the file: close(2) returns after the FLUSH, and the kernel sends the RELEASE after it,
# on its own (as the native engine's OpenTable waits for in-flight RELEASEs: conflict_wait)
RELEASE_WAIT = 2.0


def attr_dict(a) -> dict:
    return asdict(a)


class CallEdge:
    """Where every namespace call to the head runs (from other nodes, and the head's own).

    Order.  Which closes a close overlapped is told as on one host (acache.fs.overlap), with
    the order in which calls reach the head standing in for the kernel's request numbers: if
    X's close returned on any host before Y's close began there, X's reply left the head before
    Y's call arrived.  So Y lands after every call that had replied when it arrived, and may
    commit alongside those still in flight (the ranks' shards of one checkpoint step closing at
    the same moment on several hosts); without this, every close would wait for all entries
    journaled before it reached the head, in flight or not.  A close from another node can
    reach the head milliseconds after it began there (its daemon, then the link), when the
    head's own ranks' closes of the same step are acknowledged already: so the node sends a
    Began notice when its engine reads the FLUSH, and the close is numbered by that notice's
    arrival (:meth:`began`), the earliest the head can know of it.

    Acknowledgement.  The namespace's KV is written behind (store.GroupCommit): a call is
    answered only once what it changed, or saw, has landed in etcd; MetaError (EIO at the
    caller) if that failed -- and then it was undone."""

    BEGAN_KEPT = 4096      # notices kept for closes yet to come (older ones: forgotten)

    def __init__(self, meta) -> None:
        self.meta = meta
        self.overlap = Overlap()
        self._arrivals = itertools.count(1)
        self._lock = threading.Lock()
        self._began: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.began_used: dict[str, int] = {}   # node -> closes numbered by their notice

    def began(self, frm: str, tokens: list[str]) -> None:
        """Closes began on node ``frm`` (its Began notice, sent when its engine read their
        FLUSH): each is numbered now, as if it arrived now.  Sound: if X's close returned
        anywhere before one of these began, X's reply left here before this notice was even
        sent.  A notice that never meets its close (lost, or the close came first) ages out."""
        with self._lock:
            for t in tokens:
                u = next(self._arrivals)
                self.overlap.seen(u)
                self._began[(frm, t)] = u
            while len(self._began) > self.BEGAN_KEPT:
                self._began.popitem(last=False)

    def run(self, fn: Callable[..., dict], *args, began: tuple[str, str] | None = None) -> dict:
        u = None
        if began is not None:        # the close's notice came first: its number stands
            with self._lock:
                u = self._began.pop(began, None)
                if u is not None:
                    self.began_used[began[0]] = self.began_used.get(began[0], 0) + 1
        if u is None:
            u = next(self._arrivals)
            self.overlap.seen(u)
        since = self.meta.mark()
        try:
            self.meta.ready()
            with self.meta.op(self.overlap.floor(u)):
                out = fn(*args)
            self.meta.wait_visible(since)
        finally:
            seq = self.meta.journaled()
            if seq:
                self.overlap.replied(seq)     # before the reply, even an error's
        return out


class HeadNamespace(Namespace):
    """The namespace of a cluster (acache.fs.namespace), with its open files: opens come
    from nodes by id, as write and read sessions; no file is open in this process."""

    def __init__(self, meta, cache, under, persister: Persister, *, node_id: str,
                 notify: Callable[[str, str, int, int], None], chunk_size: int = 8 << 20) -> None:
        super().__init__(meta, cache, under, persister)
        # the persister's copies pulled from holders (_Head.pull, acache.cluster.member) go through a ReadThrough
        self.fetch = ReadThrough(under, chunk_size, cache=cache)
        self.fetch.settle = getattr(persister, "wait_moves", None)
        persister.attach(self)
        meta.attach(self)
        self.node_id = node_id
        self.notify = notify             # (holder, "drop"|"clean", ino, gen), best effort
        # ino -> [the node writing it, 1 while a handle there is not closed, 0 once its last
        # close (FLUSH) came and only the RELEASE is due] (one session per node: ClientVFS
        # counts its handles); (ino, gen) -> {node: read opens}
        # All of these but placed_load are in the KV too (acache.cluster.sessions), loaded
        # here when this node takes the head role over.
        loaded = S.load(meta.kv)
        self.writers: dict[int, list] = loaded.writers
        self._released = threading.Condition(self.lock)     # a session ended (end_write)
        self.ropens: dict[tuple[int, int], dict[str, int]] = loaded.ropens
        # old gens a writer copies from: (ino, gen) -> {node: writers copying}
        self.pinned: dict[tuple[int, int], dict[str, int]] = loaded.pinned
        self._holder_of: dict[tuple[int, int], str] = loaded.holder_of   # superseded gens still held
        # generations this head made that no other node has opened for reading since: only
        # those may be written in place by their holder (open_write), since a node that read
        # one may keep its bytes (ReadThrough's chunks, its copy) under the same (ino, gen).
        # Not durable: after a takeover nothing is known, and every reopen gets a new
        # generation; bounded (the oldest are forgotten, the same conservative answer)
        self._unread: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
        # the write sessions of cacheless writers, by inode: the worker each was placed on,
        # and per worker how many are open (what bounds the next placement: placement.bounded)
        self.placed: dict[int, str] = loaded.placed
        self.placed_load: dict[str, int] = {}
        for w in self.placed.values():
            self.placed_load[w] = self.placed_load.get(w, 0) + 1
        if loaded.count():
            log.info("head: %d write sessions, %d read-open and %d copied generations loaded",
                     len(loaded.writers), len(loaded.ropens), len(loaded.pinned))

    # the namespace's size of a file open for writing is what its writer's close or fsync
    # recorded (the writer's ClientVFS overlays its own): _write_fd stays Namespace's None --
    # the head's cache may hold that generation too, an empty copy being filled for a reader
    # here, and its size is not the file's

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, ctx: Ctx,
              holder: str = "") -> Attr:
        """A regular file made by mknod(2) on ``holder``: created and closed empty."""
        if not stat.S_ISREG(mode):
            raise FsError(errno.EPERM)
        holder = holder or self.node_id
        out = self.create_file(parent, name, mode, os.O_WRONLY | os.O_EXCL, ctx, holder)
        now = time.time_ns()
        self.close_write(out["ino"], out["gen"], holder, 0, now, now)
        self.end_write(out["ino"], out["gen"], holder)
        return self.getattr(out["ino"])

    # -- who has what open -------------------------------------------------------------
    def withdraw_put(self, e) -> bool:
        return False                     # a writer's own close re-journals (ClientVFS)

    def _open_count(self, ino: int) -> int:
        n = 1 if ino in self.writers else 0
        return n + sum(sum(d.values()) for (i, _), d in self.ropens.items() if i == ino)

    def _remote_open(self, ino: int, gen: int) -> bool:
        return bool(self.ropens.get((ino, gen))) or bool(self.pinned.get((ino, gen))) or \
            (ino in self.writers and getattr(self.meta.get(ino), "gen", None) == gen)

    def gc_gen(self, ino: int, gen: int) -> None:
        # once what made the generation unneeded has landed in etcd: a failed write restores
        # the entries that need it (MetaStore.heal), and they must find its bytes
        self.meta.after_durable(lambda: self._gc_gen(ino, gen))

    def _gc_gen(self, ino: int, gen: int) -> None:
        with self.lock:
            node = self.meta.get(ino)
            if self.meta.gen_pending(ino, gen) or self.persister.uses(ino, gen) \
                    or self._remote_open(ino, gen):
                return
            holder = node.node if node is not None and node.gen == gen else self._holder_of.get((ino, gen), "")
            if node is not None and node.gen == gen:
                if not node.dirty and not self.meta.puts_of(ino) and node.upath is not None \
                        and node.cached and not node.local:
                    if self.cache.exists(ino, gen):
                        self.cache.note(ino, gen, dirty=False)     # a pulled copy
                    if holder:
                        self.notify(holder, "clean", ino, gen)
                return
            self._holder_of.pop((ino, gen), None)
            if not self.cache.is_open(ino, gen):
                self.fetch.forget(ino, gen)
                if holder != self.node_id:
                    self.cache.remove(ino, gen)          # a pulled copy, if any
            if holder:
                self.notify(holder, "drop", ino, gen)

    # -- opens from nodes ---------------------------------------------------------------
    def _busy(self, ino: int, node: str) -> None:
        """EBUSY if another node writes the file (called with the lock held).  A node that
        closed every handle of it has its RELEASE on the way: wait up to RELEASE_WAIT for it."""
        w = self.writers.get(ino)
        if w is not None and w[0] != node and not w[1]:
            def settled() -> bool:
                cur = self.writers.get(ino)
                return cur is None or cur[0] == node or bool(cur[1])
            self._released.wait_for(settled, RELEASE_WAIT)
            w = self.writers.get(ino)
        if w is not None and w[0] != node:
            log.warning("open for writing of inode %d on %s refused: it is open for writing on %s",
                        ino, node, w[0])
            raise FsError(errno.EBUSY)

    def _placed_on(self, ino: int, worker: str) -> None:
        """A cacheless writer's write session of ``ino`` started on ``worker`` (lock held)."""
        self._unplace(ino)
        self.placed[ino] = worker
        self.placed_load[worker] = self.placed_load.get(worker, 0) + 1

    def _unplace(self, ino: int) -> None:
        """The write session of ``ino`` ended (lock held); nothing if it was not placed."""
        w = self.placed.pop(ino, None)
        if w is not None:
            left = self.placed_load.get(w, 0) - 1
            if left > 0:
                self.placed_load[w] = left
            else:
                self.placed_load.pop(w, None)

    def _source(self, node: Inode) -> dict:
        # persisted: the under-storage holds this generation at upath (no PUT or move of it
        # pending, not open for writing): a reader whose holder does not answer reads it there
        persisted = node.upath is not None and not node.dirty and node.nlink > 0 and \
            node.ino not in self.writers and \
            not self.meta.puts_of(node.ino) and not self.meta.moves_of(node.ino)
        return {"gen": node.gen, "holder": node.node, "cached": node.cached,
                "upath": node.upath, "size": node.size, "persisted": persisted}

    def open_write(self, ino: int, trunc: bool, holder: str,
                   place: Callable[[int, Mapping[str, int]], str] | None = None,
                   copy_max: int | None = None) -> dict:
        """A write session of ``holder`` on the file: always a generation of its own (never
        one a PUT or a reader elsewhere refers to), unless it has one open already, or the
        holder reopens a file whose PUT has not started (written in place, below).
        ``place``: the writer has no cache (acache.cluster.cacheless): the new generation's
        holder is ``place(ino, placed_load)``, a worker, not the writer.  ``copy_max``:
        schema.OpenWrite."""
        with self.lock:
            node = self._node(ino)
            if node.is_dir:
                raise FsError(errno.EISDIR)
            self._busy(ino, holder)
            w = self.writers.get(ino)
            if w is not None:            # the node opens it again: the same session
                w[1] = 1
                if trunc:
                    node.size = 0
                return {"gen": node.gen, "same": True, "src": None, "holder": node.node,
                        "attr": attr_dict(self.attr(node))}
            unread = (ino, node.gen) in self._unread
            if place is None and node.node == holder and node.cached and node.nlink > 0 \
                    and unread and not self._remote_open(ino, node.gen) \
                    and self._newest_unstarted(ino, node.gen):
                # its holder opens it again and its pending PUT is the journal's newest entry,
                # not started, read by nobody: nothing can overtake it, so the holder writes
                # its cache file in place and the next close journals it again -- no copy of
                # the whole file (fio's create, fallocate, close, reopen), as on one host
                txn = self.meta.txn()
                journal.on_reopen(self.meta, txn, self.persister, node)
                if trunc:
                    node.size = 0
                    node.synced = min(node.synced, 0)
                    node.mtime_ns = node.ctime_ns = time.time_ns()
                return self._write_in_place(txn, node, holder)
            if place is None and node.node == holder and node.cached and node.nlink > 0 \
                    and not trunc and copy_max is not None and node.size > copy_max \
                    and unread and not self._remote_open(ino, node.gen) \
                    and self._put_unstarted(node):
                # its holder opens a big file again whose PUT has not landed, and copying
                # it there would be costly (no reflinks): write it in place; its PUT keeps
                # its place in the journal but waits for this writer's close, and then
                # commits what the file holds by then, as on one host (journal.hold_put)
                txn = self.meta.txn()
                if journal.hold_put(self.meta, txn, self.persister, node):
                    return self._write_in_place(txn, node, holder)
            src = None if trunc or not node.size else self._source(node)
            new_holder = place(ino, self.placed_load) if place is not None else holder
            old_gen, old_holder = node.gen, node.node
            txn = self.meta.txn()
            self._holder_of[(ino, old_gen)] = old_holder
            node.gen += 1
            self._unread.pop((ino, old_gen), None)
            self._made_unread(ino, node.gen)
            node.node = new_holder
            node.cached = True
            if trunc:
                node.size = 0
                node.synced = min(node.synced, 0)
                node.mtime_ns = node.ctime_ns = time.time_ns()
            node.dirty = True
            txn.save(node)
            S.save_writer(txn, ino, [holder, 1], new_holder if place is not None else None)
            pins = dict(self.pinned.get((ino, old_gen), {}))
            if src is not None:
                pins[holder] = pins.get(holder, 0) + 1
                S.save_count(txn, S.pin_key(ino, old_gen, holder), pins[holder], old_holder)
            txn.commit()
            self.writers[ino] = [holder, 1]
            if place is not None:
                self._placed_on(ino, new_holder)
            if src is not None:
                self.pinned[(ino, old_gen)] = pins
            else:
                self.gc_gen(ino, old_gen)
            return {"gen": node.gen, "same": False, "src": src, "holder": node.node,
                    "attr": attr_dict(self.attr(node))}

    UNREAD_MAX = 1 << 16

    def _made_unread(self, ino: int, gen: int) -> None:
        self._unread[(ino, gen)] = None
        while len(self._unread) > self.UNREAD_MAX:
            self._unread.popitem(last=False)

    def _write_in_place(self, txn, node: Inode, holder: str) -> dict:
        """open_write's session on the generation ``node`` has (lock held; ``txn`` has
        what the caller changed): committed, and the reply."""
        node.dirty = True
        txn.save(node)
        S.save_writer(txn, node.ino, [holder, 1], None)
        txn.commit()
        self.writers[node.ino] = [holder, 1]
        return {"gen": node.gen, "same": True, "src": None, "holder": node.node,
                "attr": attr_dict(self.attr(node))}

    def create_file(self, parent: int, name: bytes, mode: int, flags: int, ctx: Ctx,
                    holder: str, place: Callable[[int, Mapping[str, int]], str] | None = None,
                    copy_max: int | None = None) -> dict:
        self._check_name(name)
        existing = self._child(parent, name)
        if existing is not None:
            if flags & os.O_EXCL:
                raise FsError(errno.EEXIST)
            if existing.is_dir:
                raise FsError(errno.EISDIR)
            out = self.open_write(existing.ino, bool(flags & os.O_TRUNC), holder, place,
                                  copy_max)
            out["ino"] = existing.ino
            return out
        with self.lock:
            p = self._dir(parent)
            if self.meta.child(parent, name) is not None:
                raise FsError(errno.EEXIST)
            txn = self.meta.txn()
            now = time.time_ns()
            gid, mode = self._group_of_new(p, ctx, mode & 0o7777)
            node = self.meta.new_inode(txn, mode=0o100000 | mode, uid=ctx.uid, gid=gid,
                                       atime_ns=now, mtime_ns=now, ctime_ns=now, parent=parent,
                                       name=name, dirty=True, cached=True, node=holder)
            if place is not None:
                try:
                    node.node = place(node.ino, self.placed_load)
                except FsError as e:             # no live worker: undo the uncommitted inode
                    self.meta.after_failure(e)
                    raise
            txn.link(parent, name, node.ino)
            self._touch_dir(txn, p)
            S.save_writer(txn, node.ino, [holder, 1], node.node if place is not None else None)
            txn.commit()
            self._made_unread(node.ino, node.gen)
            self.writers[node.ino] = [holder, 1]
            if place is not None:
                self._placed_on(node.ino, node.node)
            # pattr: the directory as this create left it (the kernel asks for it next: it
            # drops a directory's attributes at each create in it)
            return {"ino": node.ino, "gen": node.gen, "same": False, "src": None,
                    "holder": node.node, "attr": attr_dict(self.attr(node)),
                    "pattr": attr_dict(self.attr(p))}

    def copied(self, ino: int, gen: int, holder: str = "") -> None:
        """A writer on ``holder`` finished copying generation ``gen`` (its open's ``src``)."""
        with self.lock:
            pins = self.pinned.get((ino, gen))
            if not pins:
                return
            if holder not in pins:
                holder = next(iter(pins))
            left = pins[holder] - 1
            txn = self.meta.txn()
            S.save_count(txn, S.pin_key(ino, gen, holder), left, self._holder_of.get((ino, gen), ""))
            txn.commit()
            if left > 0:
                pins[holder] = left
            else:
                del pins[holder]
            if not pins:
                self.pinned.pop((ino, gen), None)
                self.gc_gen(ino, gen)

    def _writes(self, node: Inode | None, gen: int, writer: str) -> bool:
        """Is ``writer`` the node writing generation ``gen``: its holder, or the cacheless
        client that has it open for writing on a worker (acache.cluster.cacheless)?"""
        if node is None or node.gen != gen:
            return False
        w = self.writers.get(node.ino)
        return node.node == writer or (w is not None and w[0] == writer)

    def close_write(self, ino: int, gen: int, holder: str, size: int, mtime_ns: int,
                    ctime_ns: int, again: bool = False) -> None:
        """The holder's last writer closed the file: journal its commit (a PUT).  ``again``
        (schema.Close): only if the PUT its last close journaled has started."""
        with self.meta.op(), self.lock:
            w = self.writers.get(ino)
            if w is not None and w[0] == holder:
                w[1] = 0                 # closed there; the session ends with its RELEASE
            node = self.meta.get(ino)
            if node is None or not self._writes(node, gen, holder):
                return
            if again and self._put_unstarted(node):
                return
            txn = self.meta.txn()
            if w is not None and w[0] == holder:
                S.save_writer(txn, ino, w, self.placed.get(ino))
            node.size = size
            node.mtime_ns = max(node.mtime_ns, mtime_ns)
            node.ctime_ns = max(node.ctime_ns, ctime_ns)
            self._journal_commit(txn, node)
            node.dirty = False
            node.synced = -1
            node.local = ""
            txn.save(node)
            txn.commit()
        self.persister.wake()

    def _journal_commit(self, txn, node: Inode) -> None:
        """Journal ``node``'s commit in ``txn``: a PUT of its generation from where its bytes
        are (its holder; a worker, for a cacheless writer).  A PUT an earlier close journaled
        and the persister has started keeps its place (journal.journal_put cancels only those
        not started that this one supersedes): whatever was journaled after that close returned
        (a step's marker) must land after what that close acknowledged, and a new PUT comes
        after it."""
        if node.nlink > 0:
            e = journal.journal_put(self.meta, txn, self.persister, node)
            e.node = node.node
            txn.update_entry(e)

    def _put_unstarted(self, node: Inode) -> bool:
        """Does a PUT of ``node``'s generation wait in the journal, not started (so it reads
        what the cache file holds when it starts)?"""
        return any(e.gen == node.gen and self.persister.state(e.seq) == ""
                   for e in self.meta.puts_of(node.ino))

    def end_write(self, ino: int, gen: int, holder: str, again: bool = False) -> None:
        """The holder released its last write handle of the file.  ``again``
        (schema.EndWrite): the kernel wrote it directly; journal it again in the same batch
        unless the PUT its last close journaled has not started."""
        with self.meta.op(), self.lock:
            w = self.writers.get(ino)
            if w is None or w[0] != holder:
                return
            node = self.meta.get(ino)
            txn = self.meta.txn()
            S.save_writer(txn, ino, None, None)
            again = (again and node is not None and self._writes(node, gen, holder)
                     and node.nlink > 0 and not node.dirty and not self._put_unstarted(node))
            if again and node is not None:
                self._journal_commit(txn, node)
                txn.save(node)
            txn.commit(lazy=True)        # a RELEASE: it may share the next call's etcd write
            del self.writers[ino]
            self._unplace(ino)
            self._released.notify_all()
        if again:
            self.persister.wake()
        self._settle(ino, gen, node)

    def _settle(self, ino: int, gen: int, node: Inode | None) -> None:
        if node is not None and node.nlink == 0 and not self._open_count(ino):
            self._reap(node)
        else:
            self.gc_gen(ino, gen)

    def reopen_write(self, ino: int, gen: int, holder: str) -> None:
        """The holder writes on after a close that came from a copy of the descriptor: what
        that close journaled and has not started is cancelled (journal.on_reopen)."""
        with self.lock:
            node = self.meta.get(ino)
            if node is None or node.gen != gen:
                return
            txn = self.meta.txn()
            journal.on_reopen(self.meta, txn, self.persister, node)
            node.dirty = True
            txn.save(node)
            txn.commit()

    def sync_write(self, ino: int, gen: int, holder: str, size: int, mtime_ns: int) -> None:
        """fsync on the holder: its bytes are durable there; the size is recorded durably."""
        with self.lock:
            node = self.meta.get(ino)
            if node is None or not self._writes(node, gen, holder):
                self.meta.sync()
                return
            node.size = size
            node.mtime_ns = max(node.mtime_ns, mtime_ns)
            node.synced = size
            txn = self.meta.txn()
            txn.save(node)
            txn.commit(sync=True)

    def source(self, ino: int) -> dict:
        """Where the current generation of ``ino`` is (no read session: a reader checking,
        before it reads the under-storage instead of a silent holder, that it still may)."""
        with self.lock:
            return self._source(self._node(ino))

    def open_read(self, ino: int, holder: str) -> dict:
        with self.lock:
            node = self._node(ino)
            if node.is_dir:
                raise FsError(errno.EISDIR)
            key = (ino, node.gen)
            if holder != node.node:
                self._unread.pop(key, None)      # it may keep what it reads: no writes in place
            n = self.ropens.get(key, {}).get(holder, 0) + 1
            txn = self.meta.txn()
            S.save_count(txn, S.read_key(ino, node.gen, holder), n, node.node)
            txn.commit()
            self.ropens.setdefault(key, {})[holder] = n
            out = self._source(node)
            out["attr"] = attr_dict(self.attr(node))
            w = self.writers.get(ino)
            out["writing"] = w is not None and w[0] != holder     # that generation is not done
            return out

    def end_read(self, ino: int, gen: int, holder: str) -> None:
        with self.lock:
            d = self.ropens.get((ino, gen))
            if d is None or holder not in d:
                return
            cur = self.meta.get(ino)
            txn = self.meta.txn()
            S.save_count(txn, S.read_key(ino, gen, holder), d[holder] - 1,
                         cur.node if cur is not None and cur.gen == gen else
                         self._holder_of.get((ino, gen), ""))
            txn.commit(lazy=True)        # a RELEASE, as end_write's
            d[holder] -= 1
            if d[holder] <= 0:
                del d[holder]
            if not d:
                del self.ropens[(ino, gen)]
            node = self.meta.get(ino)
        self._settle(ino, gen, node)

    def evict(self, ino: int, gen: int, holder: str) -> bool:
        """May ``holder`` drop its cache file of (ino, gen)?  The holder's copy of the
        current generation only once it is persisted (the file then reads through)."""
        with self.lock:
            node = self.meta.get(ino)
            if self.meta.gen_pending(ino, gen) or self.persister.uses(ino, gen):
                return False                 # a PUT still needs these bytes (a copy may
                                             # be where the head pulls them from)
            if node is None or node.gen != gen or node.node != holder:
                return True                  # a copy, or a generation nobody needs
            if node.dirty or node.local or self.meta.puts_of(ino) or node.upath is None \
                    or ino in self.writers:
                return False
            node.cached = False
            txn = self.meta.txn()
            txn.save(node)
            try:
                txn.commit()
            except AcacheError:
                return False
            return True

    def rejoin(self, holder: str, files: dict[int, tuple[int, int]]) -> dict:
        """``holder`` (re)started: forget what it had open; files it was writing when it
        stopped are published if an fsync acknowledged them (and its cache file holds at
        least that: ``files`` maps ino -> (gen, size) of what it has), else kept out of the
        under-storage, as on one host (VFS._recover_dirty)."""
        out = {"reopened": 0, "unacknowledged": 0}
        with self.lock:
            txn = self.meta.txn()
            self._forget_sessions(txn, holder)
            journaled = []
            for node in self.meta.inodes():
                if node.is_dir or node.node != holder or not node.dirty:
                    continue
                have = files.get(node.ino)
                if have is not None and have[0] == node.gen and node.synced >= 0 \
                        and have[1] >= node.synced and node.nlink > 0:
                    node.size = have[1]
                    e = journal.journal_put(self.meta, txn, self.persister, node)
                    e.node = holder
                    txn.update_entry(e)
                    node.dirty, node.synced, node.local = False, -1, ""
                    journaled.append(node.ino)
                    out["reopened"] += 1
                else:
                    # the under-storage keeps its last closed version: a PUT of this
                    # generation held for the writer (open_write) is withdrawn, its bytes
                    # were being changed in place (as on one host, VFS._recover_dirty)
                    for e in self.meta.puts_of(node.ino):
                        if e.gen == node.gen and e.hold and \
                                self.persister.state(e.seq) != "committing":
                            txn.remove_entry(e.seq)
                    node.dirty = False
                    node.local = "open for writing on %s when it stopped, never fsynced" % holder
                    out["unacknowledged"] += 1
                txn.save(node)
            txn.commit(sync=True)
        if journaled:
            self.persister.wake()
        return out

    def _forget_sessions(self, txn, holder: str) -> list[tuple[int, int]]:
        """Drop every session of ``holder`` (lock held), in memory and in ``txn``; the
        generations it read or copied, to settle once ``txn`` is committed."""
        for ino in [i for i, w in self.writers.items() if w[0] == holder]:
            S.save_writer(txn, ino, None, None)
            del self.writers[ino]
            self._unplace(ino)
        self._released.notify_all()
        gens = []
        for table, key_of in ((self.ropens, S.read_key), (self.pinned, S.pin_key)):
            for key in list(table):
                if holder in table[key]:
                    txn.delete_raw(key_of(key[0], key[1], holder))
                    del table[key][holder]
                    gens.append(key)
                if not table[key]:
                    del table[key]
        return gens

    def session_nodes(self) -> set[str]:
        """The nodes that have a file open (for the reaper)."""
        with self.lock:
            return S.nodes_of(self.writers.values(), self.ropens.values(), self.pinned.values())

    def release_node(self, holder: str) -> None:
        """``holder`` is gone (its registration expired): its sessions end, as if it had
        closed everything -- what it was writing stays as it is (dirty: its restart
        publishes what an fsync acknowledged, rejoin); what it read may be let go of."""
        with self.lock:
            txn = self.meta.txn()
            gens = self._forget_sessions(txn, holder)
            txn.commit()
            nodes = [(ino, gen, self.meta.get(ino)) for ino, gen in gens]
        for ino, gen, node in nodes:
            self._settle(ino, gen, node)

    def recover(self) -> dict:
        """A new head: clean up half-done stages (the node-local half of recovery, cache
        files against the namespace, is each node's own: ClientVFS.recover)."""
        out = {"stages": 0}
        with self.lock:
            tokens = [e.token for e in self.meta.journal() if e.token]
            orphans = self.meta.orphan_stages()
        cleaned = set()
        for token in tokens + orphans:
            try:
                self.under.cleanup(token)
                cleaned.add(token)
            except Exception as err:
                log.warning("cleaning up after the stage %s failed: %s", token, err)
        with self.lock:
            txn = self.meta.txn()
            for e in self.meta.journal():
                if e.token and e.token in cleaned:
                    e.token = ""
                    txn.update_entry(e)
                    out["stages"] += 1
            for token in orphans:
                if token in cleaned:
                    txn.forget_stage(token)
            for node in self.meta.inodes():
                if node.nlink == 0 and not node.is_dir:
                    txn.drop_inode(node.ino)
            txn.commit(sync=True)
        return out
