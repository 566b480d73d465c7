"""Where the head puts a file written by a node without a cache (``placement = "hash"``).

    p = Placement(cluster)          # acache.meta.cluster.Cluster; watches membership
    p.choose(ino, load)             # the live worker for this inode: rendezvous hashing,
                                    # bounded by ``load`` (worker -> files open for writing)
    p.workers()                     # the live workers now, by id
    p.close()

Workers are the registered members that are alive and advertise the ``worker`` capability
(a node with a cache of its own; acache.cluster.member registers it).  The choice is
rendezvous (highest-random-weight) hashing of the **inode number** over them: every worker
scores ``blake2b(worker id, ino)`` and the highest wins.  So a rename never moves data (the
inode, not the path, is hashed), and a worker that joins or leaves changes the choice only
for the inodes it wins or won (1/n of them): nothing else moves, and new files go to a new
worker at once.  A file already placed keeps its holder (Inode.node) for as long as its
generation lives; only a new write session is placed again.

The hash alone spreads files evenly only on average: 18 writers into 3 workers get 6 each in
expectation, but a given set of inodes may give one worker 4 and another 9, and a checkpoint
ends when its busiest worker has written its share (and a worker with no file open idles its
disk).  So the choice has **bounded loads** (consistent hashing with bounded loads, Mirrokni,
Thorup and Zadimoghaddam 2018): the head counts each worker's placed files open for writing,
and a new file goes to the first worker *in the inode's rendezvous order* whose count is below
``ceil((open + 1) / workers)`` -- the hash's first choice whenever that keeps the workers
even, the next one in the inode's own order when it does not.  A worker whose files take
longer to write (a slower disk or link) keeps them open longer and so gets fewer new ones.  The
choice is recorded as the file's holder, so nothing ever needs to recompute it.

Membership is read from etcd: a snapshot, refreshed after any change the watch reports (the
next ``choose`` reads the members again: one range read per burst of changes), and on every
call while the watch is broken.  A worker that died shows as gone once its lease expires
(acache.cluster.member.LEASE_TTL); a file placed on it in that window fails at its first
write (the client's EIO), as a write to a worker that dies later does.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import threading
from typing import Mapping

from acache.errors import FsError

log = logging.getLogger("acache.cluster.placement")

WORKER = "worker"               # the capability of a node that takes placed files


def score(node_id: str, ino: int) -> int:
    h = hashlib.blake2b(node_id.encode() + b"\0" + ino.to_bytes(8, "big"), digest_size=8)
    return int.from_bytes(h.digest(), "big")


def rendezvous(ino: int, nodes: list[str]) -> str:
    """The node of ``nodes`` that ``ino`` belongs to (highest score; ties by id)."""
    return max(nodes, key=lambda n: (score(n, ino), n))


def bounded(ino: int, nodes: list[str], load: Mapping[str, int]) -> str:
    """The first of ``nodes`` in ``ino``'s rendezvous order whose ``load`` (files open on it;
    absent = 0) is below ``ceil((total + 1) / len(nodes))``: the cap a new file may fill.
    Some node is always below it (the total of all loads is below ``len(nodes)`` times it)."""
    total = sum(load.get(n, 0) for n in nodes)
    cap = -(-(total + 1) // len(nodes))
    for n in sorted(nodes, key=lambda n: (score(n, ino), n), reverse=True):
        if load.get(n, 0) < cap:
            return n
    raise AssertionError("unreachable: some node is below the cap")


class Placement:
    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self._lock = threading.Lock()
        self._stale = True
        self._broken = False
        self._workers: list[str] = []
        self._watch = None
        try:
            self._watch = cluster.watch(self._changed, on_error=self._watch_failed)
        except Exception as e:          # no watch: read the members on every choice
            log.warning("watching the cluster's members failed (%s): placement reads them "
                        "at every new file", e)
            self._broken = True

    def _changed(self, ev) -> None:
        self._stale = True

    def _watch_failed(self, err: Exception) -> None:
        log.warning("the watch of the cluster's members failed (%s): placement reads them "
                    "at every new file", err)
        self._broken = True

    def workers(self) -> list[str]:
        """The live workers (ids, sorted), fresh as of the last membership change."""
        if self._stale or self._broken:
            with self._lock:
                if self._stale or self._broken:
                    self._stale = False      # a change from now on makes it stale again
                    self._workers = [m.record.id for m in self.cluster.members()
                                     if m.alive and WORKER in m.record.capabilities]
        return list(self._workers)

    def choose(self, ino: int, load: Mapping[str, int] | None = None) -> str:
        """The live worker for a new write session of ``ino``; ``load``: each worker's placed
        files open for writing now (``bounded``), none = the plain rendezvous choice."""
        nodes = self.workers()
        if not nodes:
            log.error("no live cache worker to place inode %d on: EIO", ino)
            raise FsError(errno.EIO)
        return bounded(ino, nodes, load) if load else rendezvous(ino, nodes)

    def close(self) -> None:
        if self._watch is not None:
            try:
                self._watch.stop()
            except Exception:
                pass
