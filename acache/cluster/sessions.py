"""The open-file sessions of the cluster's nodes, durable in the namespace's KV.

Who has which file open is what the head's rules rest on: one writer per file (a second
node's open for writing is EBUSY), and the generations a reader elsewhere still reads (or a
writer still copies from) are kept on their holder after the file was overwritten.  The head
keeps them in memory (HeadNamespace.writers / ropens / pinned) and writes every change of them in
the batch of the operation that made it, so a new head -- after a kill -9 of the old one --
loads them and enforces the same rules (as JuiceFS keeps its sessions in its engine, 3FS its
file sessions in FoundationDB):

    W<ino:u64>                      -> msgpack [node, open, placed]   a write session: the node
                                       writing it; open: 1 while a handle there is not closed,
                                       0 once its last close came (its RELEASE is due);
                                       placed: the worker a cacheless writer's bytes go to
    O<ino:u64><gen:u64><node>       -> msgpack [count, holder]   read opens of a generation on
                                       a node, and the holder of that generation's bytes
    P<ino:u64><gen:u64><node>       -> msgpack [count, holder]   writers on a node copying the
                                       generation (an open's ``src``) until ``copied``

A node that dies does not come back to close what it had open: the head's :class:`Reaper`
releases the sessions of nodes whose registration is gone (their lease expired: TTL seconds
after they stopped answering etcd), so their files do not stay locked, nor their readers'
generations pinned, forever.  A node that restarts releases its own at rejoin.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable

import msgpack

from acache.meta import schema as K

log = logging.getLogger("acache.cluster.sessions")
WRITE, READ, PIN = b"W", b"O", b"P"
REAP_EVERY = 1.0             # seconds between the reaper's looks at the registrations


def writer_key(ino: int) -> bytes:
    return WRITE + K.u64(ino)


def read_key(ino: int, gen: int, node: str) -> bytes:
    return READ + K.u64(ino) + K.u64(gen) + node.encode()


def pin_key(ino: int, gen: int, node: str) -> bytes:
    return PIN + K.u64(ino) + K.u64(gen) + node.encode()


def save_writer(txn, ino: int, w: list | None, placed: str | None) -> None:
    """The write session of ``ino`` as it is now in memory (None: it ended), into ``txn``."""
    if w is None:
        txn.delete_raw(writer_key(ino))
    else:
        txn.put_raw(writer_key(ino), msgpack.packb([w[0], int(w[1]), placed or ""]))


def save_count(txn, key: bytes, count: int, holder: str) -> None:
    if count > 0:
        txn.put_raw(key, msgpack.packb([count, holder]))
    else:
        txn.delete_raw(key)


class Loaded:
    """What the KV holds, in the shapes HeadNamespace keeps in memory."""

    def __init__(self) -> None:
        self.writers: dict[int, list] = {}
        self.placed: dict[int, str] = {}
        self.ropens: dict[tuple[int, int], dict[str, int]] = {}
        self.pinned: dict[tuple[int, int], dict[str, int]] = {}
        self.holder_of: dict[tuple[int, int], str] = {}

    def count(self) -> int:
        return len(self.writers) + len(self.ropens) + len(self.pinned)


def load(kv) -> Loaded:
    out = Loaded()
    for k, v in kv.scan(WRITE):
        node, is_open, placed = msgpack.unpackb(v, raw=False)
        ino = K.from_u64(k[1:9])
        out.writers[ino] = [node, int(is_open)]
        if placed:
            out.placed[ino] = placed
    for prefix, into in ((READ, out.ropens), (PIN, out.pinned)):
        for k, v in kv.scan(prefix):
            ino, gen, node = K.from_u64(k[1:9]), K.from_u64(k[9:17]), k[17:].decode()
            count, holder = msgpack.unpackb(v, raw=False)
            into.setdefault((ino, gen), {})[node] = int(count)
            if holder:
                out.holder_of[(ino, gen)] = holder
    return out


def nodes_of(*tables: Iterable) -> set[str]:
    """The nodes that have a session in HeadNamespace's tables."""
    out: set[str] = set()
    for t in tables:
        for v in t:
            if isinstance(v, list):
                out.add(v[0])
            else:
                out.update(v)
    return out


class Reaper:
    """Every ``every`` seconds: ``release(node)`` for each node that has sessions
    (``holders()``) and no live registration (``alive()``; None: unknown, nothing done)."""

    def __init__(self, holders: Callable[[], set[str]], alive: Callable[[], set[str] | None],
                 release: Callable[[str], None], every: float = REAP_EVERY) -> None:
        self.holders, self.alive, self.release, self.every = holders, alive, release, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="acache-session-reaper", daemon=True)
        self._thread.start()

    def once(self) -> list[str]:
        held = self.holders()
        if not held:
            return []
        alive = self.alive()
        if alive is None:
            return []
        gone = sorted(held - alive)
        for node in gone:
            log.warning("node %s is gone (its registration expired): releasing the files it "
                        "had open", node)
            self.release(node)
        return gone

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.once()
            except Exception as e:         # noqa: BLE001 - tried again at the next round
                log.warning("releasing the sessions of gone nodes: %s", e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
