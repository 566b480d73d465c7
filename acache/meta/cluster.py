"""What a cluster member needs from etcd: membership with leased liveness, a watch of it,
cluster-unique inode numbers in reserved batches, and the cluster-wide revision.

Keys under the client's prefix ``/acache/NAME/``:

    members/node/<id>    -> msgpack NodeRecord   kept after the node stops (it may come back)
    members/alive/<id>   -> lease id (decimal)   leased: gone TTL seconds after the last keepalive
    counters/next_ino    -> u64 (big-endian)     the next inode number nobody was given

A member is *alive* while its alive key exists.  ``register`` puts both keys (the alive key
attached to a fresh lease) and keeps the lease alive from the client's keepalive thread; if
the lease expires anyway (etcd unreachable for longer than the TTL) the registration puts
them again under a new lease.  Registering an id that is already registered replaces its
record (a restart of the same node).

One process per id: ``register`` is a txn guarded by the alive key's ``mod_revision`` as the
caller saw it (``expect``; 0: no live registration) -- from ``holder(id)``, after the caller
made sure that registration is a stale one of its own (acache.cluster.member asks the
address).  Of two processes registering one id at once only one wins; the other gets
``IdInUse`` naming the winner.  (A keepalive does not change the key's mod_revision; a
re-registration does.)  A lost reply is told apart by the alive key's value: the caller's
own new lease id.  A re-registration after a lost lease expects no alive key, so it never
replaces a process that took the id meanwhile.

Inode numbers: ``reserve_inodes(n)`` is a compare-and-swap on the counter (its mod_revision).
A CAS whose reply was lost and whose retry then fails is *not* assumed to be ours: the loop
reads again and reserves again, so a batch may be wasted (as it is when a client dies holding
one) but no number is ever handed out twice.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import msgpack

from acache.meta.etcd import Compare, Delete, EtcdClient, Event, Keepalive, Put, Range, Watch
from acache.meta.schema import from_u64, u64

log = logging.getLogger("acache.meta.cluster")


@dataclass(frozen=True)
class NodeRecord:
    id: str
    address: str                    # host:port peers reach it at
    capabilities: tuple[str, ...]   # e.g. ("rdma", "passthrough")
    started: float                  # wall-clock time of its start (time.time())

    def pack(self) -> bytes:
        return msgpack.packb([self.id, self.address, list(self.capabilities), self.started])

    @staticmethod
    def unpack(b: bytes) -> "NodeRecord":
        i, a, caps, s = msgpack.unpackb(b)
        return NodeRecord(i, a, tuple(caps), s)


@dataclass(frozen=True)
class Member:
    record: NodeRecord
    alive: bool


@dataclass(frozen=True)
class MemberEvent:
    node_id: str
    change: str                     # "up" | "down" | "record" | "removed"
    revision: int


@dataclass(frozen=True)
class Holder:
    """The live registration of an id: its record and its alive key's mod_revision."""
    record: NodeRecord | None       # None: an alive key without a record (a removed node)
    revision: int


class IdInUse(Exception):
    """Another live registration holds the id (``holder``: who, as read after the refusal)."""

    def __init__(self, node_id: str, holder: Holder | None) -> None:
        addr = holder.record.address if holder and holder.record else "an unknown address"
        super().__init__(f"node {node_id} is registered and alive at {addr}")
        self.node_id, self.holder = node_id, holder


class Registration:
    """A registered node: its lease kept alive until :meth:`stop` (which revokes it)."""

    def __init__(self, cluster: "Cluster", record: NodeRecord, ttl: float) -> None:
        self.cluster = cluster
        self.record = record
        self.ttl = ttl
        self.lease_id = 0
        self._ka: Keepalive | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self.renewals = 0
        self.taken: Holder | None = None    # set if another process took the id meanwhile

    def _put(self, expect: int = 0) -> None:
        """Put the record and the alive key under a new lease if the alive key's mod_revision
        is still ``expect`` (0: absent); IdInUse if another registration got there first."""
        c, nid = self.cluster.client, self.record.id
        lease = c.lease_grant(self.ttl)
        alive = self.cluster.alive_key(nid)
        mine = str(lease).encode()
        res = c.txn([Compare.mod_revision(alive, expect)],
                    [Put(self.cluster.node_key(nid), self.record.pack()), Put(alive, mine, lease)])
        if not res.succeeded:
            cur = c.get(alive)
            if cur is None or cur.value != mine:     # not our own lost-reply attempt
                c.lease_revoke(lease)
                raise IdInUse(nid, self.cluster.holder(nid))
        with self._lock:
            if self._stopped:
                c.lease_revoke(lease)
                return
            self.lease_id = lease
            self._ka = c.keepalive(lease, self.ttl, self._lost)

    def _lost(self, lease_id: int) -> None:
        log.warning("node %s: its liveness lease expired; registering again", self.record.id)
        self.renewals += 1
        threading.Thread(target=self._reput, name="etcd-reregister", daemon=True).start()

    def _reput(self) -> None:
        try:
            self._put()
        except IdInUse as e:
            self.taken = e.holder
            log.error("node %s: another process registered this node_id while this node's "
                      "lease was lost (%s); this node stays unregistered: stop it, or give one "
                      "of them another node_id", self.record.id, e)

    def stop(self) -> None:
        """Stop the keepalive and revoke the lease (the member shows down at once)."""
        with self._lock:
            self._stopped = True
            ka, lease = self._ka, self.lease_id
        if ka is not None:
            ka.stop()
        if lease:
            self.cluster.client.lease_revoke(lease)


class Cluster:
    def __init__(self, client: EtcdClient, first_ino: int = 2) -> None:
        self.client = client
        self.first_ino = first_ino          # 1 is the root
        p = client.prefix
        self._members = p + b"members/"
        self._nodes = p + b"members/node/"
        self._alive = p + b"members/alive/"
        self._next_ino = p + b"counters/next_ino"

    def node_key(self, node_id: str) -> bytes:
        return self._nodes + node_id.encode()

    def alive_key(self, node_id: str) -> bytes:
        return self._alive + node_id.encode()

    # -- membership --------------------------------------------------------------------------
    def register(self, node_id: str, address: str, capabilities: tuple[str, ...] = (),
                 ttl: float = 10.0, expect: int = 0) -> Registration:
        """Register ``node_id`` if its alive key's mod_revision is ``expect`` (0: no live
        registration; else the one ``holder`` returned, known stale); IdInUse otherwise."""
        reg = Registration(self, NodeRecord(node_id, address, tuple(capabilities), time.time()), ttl)
        reg._put(expect)
        return reg

    def holder(self, node_id: str) -> Holder | None:
        """The live registration of ``node_id`` (None: it has none)."""
        res = self.client.txn([], [Range(self.alive_key(node_id)), Range(self.node_key(node_id))])
        alive, node = res.responses
        if not alive:
            return None
        return Holder(NodeRecord.unpack(node[0].value) if node else None, alive[0].mod_revision)

    def members(self) -> list[Member]:
        """Every registered node, alive or down, by id (one consistent snapshot)."""
        nodes: dict[str, NodeRecord] = {}
        alive: set[str] = set()
        for kv in self.client.range_prefix(self._members):
            if kv.key.startswith(self._nodes):
                nodes[kv.key[len(self._nodes):].decode()] = NodeRecord.unpack(kv.value)
            elif kv.key.startswith(self._alive):
                alive.add(kv.key[len(self._alive):].decode())
        return [Member(nodes[i], i in alive) for i in sorted(nodes)]

    def remove(self, node_id: str) -> None:
        """Forget a node (its record; its alive key too, if any)."""
        self.client.txn([], [Delete(self.node_key(node_id)), Delete(self.alive_key(node_id))])

    def watch(self, callback: Callable[[MemberEvent], None], start_revision: int = 0,
              on_error: Callable[[Exception], None] | None = None) -> Watch:
        """Membership changes from ``start_revision`` (default: from now on), in order."""
        start = start_revision or self.client.revision() + 1

        def deliver(events: list[Event]) -> None:
            for e in events:
                if e.kv.key.startswith(self._alive):
                    nid, change = e.kv.key[len(self._alive):].decode(), "up" if e.type == "put" else "down"
                else:
                    nid = e.kv.key[len(self._nodes):].decode()
                    change = "record" if e.type == "put" else "removed"
                callback(MemberEvent(nid, change, e.revision))
        return self.client.watch_prefix(self._members, start, deliver, on_error)

    # -- inode numbers -----------------------------------------------------------------------
    def reserve_inodes(self, count: int) -> range:
        """``count`` inode numbers no other caller (any client, any host) ever gets."""
        if count <= 0:
            raise ValueError("reserve at least one inode number")
        while True:
            cur = self.client.get(self._next_ino)
            start = from_u64(cur.value) if cur else self.first_ino
            guard = Compare.mod_revision(self._next_ino, cur.mod_revision if cur else 0)
            res = self.client.txn([guard], [Put(self._next_ino, u64(start + count))])
            if res.succeeded:
                return range(start, start + count)
            # lost the race, or our own lost-reply attempt applied: that batch is wasted

    # -- ordering ----------------------------------------------------------------------------
    def revision(self) -> int:
        """The cluster-wide revision now (linearizable): every change acknowledged anywhere
        before this call is at or below it; later ones above."""
        return self.client.revision()
