"""Request ids of the namespace calls to the cluster's head, durable.

    log = RequestLog(meta, edge=call_edge.run)
    reply = log.run(frm, rid, fn, durable=True)      # fn() -> dict, or raises FsError

A member names each namespace request it sends (``rid``: its node id, its boot, a counter)
and sends it again, with the same rid, when the reply did not come: a dropped connection, or
a head that died -- then to the next head.  A request sent again must be answered as its
first run was, not run twice (a second ``mkdir`` would say EEXIST, a second ``open_read``
would pin a generation forever).

So the reply of each mutating request is stored in the namespace's KV, under

    Q<node>\\0<rid>          -> msgpack [n, ok, reply | errno]

in the *same KV write* as the request's effects: the head's store writes behind
(store.GroupCommit); while the request runs, its batches are held back
(GroupCommit.hold, at most HOLD_MAX = 0.1 s) and the reply is added to the last of them.  Either
both landed or neither did: a new head that finds the record answers with it; one that does
not runs the request (its effects never landed).  If the hold ran out (a request that ran long
after its first change), the reply is written in a batch right behind the effects: a head
dying in between leaves the effects without the reply, and the request runs again (the
logged warning says so).  A request that waits for its own batch (an fsync's record) ends the
hold there; such requests are idempotent.

The last KEEP records of each node are kept: the oldest goes in the same write as the newest
(``n`` orders them, across heads).  A copy that arrives while the first is still running
waits for it.  Without a rid (the head's own calls made before it knew one) nothing is stored.
"""
from __future__ import annotations

import errno
import logging
import threading
from collections import OrderedDict, deque
from typing import Callable

import msgpack

from acache.errors import FsError

log = logging.getLogger("acache.cluster.requests")
PREFIX = b"Q"
KEEP = 1024                  # records kept per node (a member resends only its latest few)


def request_key(node: str, rid: str) -> bytes:
    return PREFIX + node.encode() + b"\0" + rid.encode()


def _split(key: bytes) -> tuple[str, str]:
    node, _, rid = key[len(PREFIX):].partition(b"\0")
    return node.decode(), rid.decode()


def _direct(fn: Callable[[], dict]) -> dict:
    return fn()


class RequestLog:
    """The stored replies of the namespace's requests (module docstring).

    ``meta``: the head's MetaStore (its KV, its lock, its group commit); ``edge``: what every
    request runs inside (CallEdge.run: the order and the acknowledgement); the reply is
    recorded inside it, so the edge's wait for durability covers the record too."""

    def __init__(self, meta, *, keep: int = KEEP,
                 edge: Callable[[Callable[[], dict]], dict] = _direct) -> None:
        self.meta = meta
        self.keep = keep
        self.edge = edge
        self._lock = threading.Lock()
        self._running: dict[str, threading.Event] = {}
        # rid -> (ok, reply | errno), per node oldest first; what the KV holds, plus the
        # replies of requests that were not stored (read-only ones), for copies in flight
        self._done: dict[str, OrderedDict[str, tuple]] = {}
        self._stored: dict[str, deque[str]] = {}        # node -> its stored rids, oldest first
        self._n = 0
        self._load()

    def _load(self) -> None:
        rows = []
        for k, v in self.meta.kv.scan(PREFIX):
            try:
                node, rid = _split(k)
                n, ok, val = msgpack.unpackb(v, raw=False)
            except (ValueError, UnicodeDecodeError, msgpack.UnpackException):
                log.warning("ignoring a malformed request record %r", k[:60])
                continue
            rows.append((n, node, rid, (bool(ok), val)))
        rows.sort(key=lambda r: r[0])
        for n, node, rid, res in rows:
            self._done.setdefault(node, OrderedDict())[rid] = res
            self._stored.setdefault(node, deque()).append(rid)
            self._n = max(self._n, n)
        if rows:
            log.info("head: %d request replies of %d nodes loaded", len(rows), len(self._stored))

    def stored(self, node: str) -> list[str]:
        """The rids of ``node`` whose replies are stored, oldest first (tests, status)."""
        with self._lock:
            return list(self._stored.get(node, ()))

    def _lookup(self, frm: str, rid: str) -> tuple | None:
        d = self._done.get(frm)
        return None if d is None else d.get(rid)

    # -- running a request ------------------------------------------------------------------
    def _edge(self, fn: Callable[[], dict], began: tuple[str, str] | None) -> dict:
        return self.edge(fn) if began is None else self.edge(fn, began=began)  # type: ignore[call-arg]

    def run(self, frm: str, rid: str, fn: Callable[[], dict], *, durable: bool = True,
            began: tuple[str, str] | None = None) -> dict:
        """``fn()``'s reply, or the first run's if ``rid`` ran already (FsError as it raised).
        ``durable``: the request changes something (its reply is stored with its effects).
        ``began``: a close's notice (acache.cluster.head.CallEdge.began), for the edge."""
        if not rid:
            return self._edge(fn, began)
        with self._lock:
            done = self._lookup(frm, rid)
            if done is not None:
                log.info("request %s of %s was sent again: answered from its first run", rid, frm)
                return _answer(done)
            ev = self._running.get(rid)
            mine = ev is None
            if mine:
                ev = self._running[rid] = threading.Event()
        assert ev is not None
        if not mine:                     # the first copy is still running: its answer
            ev.wait()
            with self._lock:
                done = self._lookup(frm, rid)
            return _answer(done if done is not None else (False, errno.EIO))
        try:
            return self._edge(lambda: self._record(frm, rid, fn, durable), began)
        finally:
            with self._lock:
                self._running.pop(rid, None)
            ev.set()

    def _record(self, frm: str, rid: str, fn: Callable[[], dict], durable: bool) -> dict:
        if durable:
            self.meta.hold()
        res: tuple = (False, errno.EIO)  # an unexpected error: EIO for a copy sent again
        try:
            out = fn()
            res = (True, out)
            return out
        except FsError as e:
            res = (False, e.errno)
            raise
        finally:
            if durable:
                self._store(frm, rid, res)
            else:
                self._remember(frm, rid, res)

    def _remember(self, frm: str, rid: str, res: tuple) -> None:
        with self._lock:
            d = self._done.setdefault(frm, OrderedDict())
            d[rid] = res
            while len(d) > self.keep:
                old, _ = d.popitem(last=False)
                if self._stored.get(frm) and self._stored[frm][0] == old:
                    self._stored[frm].popleft()

    def _store(self, frm: str, rid: str, res: tuple) -> None:
        """The reply into the held batch of the request's effects (or a batch of its own)."""
        with self._lock:
            self._n += 1
            rec = msgpack.packb([self._n, res[0], res[1]], use_bin_type=True)
            q = self._stored.setdefault(frm, deque())
            drop = []
            while len(q) >= self.keep:
                drop.append(request_key(frm, q.popleft()))
            q.append(rid)
            d = self._done.setdefault(frm, OrderedDict())
            d[rid] = res
            while len(d) > self.keep:
                d.popitem(last=False)
        puts = {request_key(frm, rid): rec}
        if self.meta.release(puts, drop):
            return
        if self.meta.group is not None:
            log.debug("request %s: its reply is written behind its effects (hold ran out)", rid)
        with self.meta.lock:
            txn = self.meta.txn()
            for k in drop:
                txn.delete_raw(k)
            for k, v in puts.items():
                txn.put_raw(k, v)
            txn.commit()


def _answer(res: tuple) -> dict:
    ok, val = res
    if ok:
        return val
    raise FsError(int(val) if isinstance(val, int) else errno.EIO)
