"""A synchronous etcd v3 client for acache (gRPC, aetcd's generated stubs, no asyncio).

    client = EtcdClient.from_url("etcd://h1:2379,h2:2379,h3:2379/NAME")   # prefix /acache/NAME/

What it offers: get, paginated prefix ranges (pinned to one revision: a consistent snapshot),
transactions (compares on mod_revision / version / create_revision / value; put, delete and
range ops), leases (grant, a keepalive thread, revoke), a watch thread delivering the events
of a prefix in revision order from a given revision, a linearizable read of the current
revision (a barrier), and periodic compaction.

Failover.  The client talks to one endpoint at a time.  An RPC failing with UNAVAILABLE,
DEADLINE_EXCEEDED (each RPC has ``rpc_timeout``), "too many requests", or a broken
connection moves the client to the next endpoint and is sent again, round-robin with a short
backoff once every endpoint failed, until ``stall_timeout`` seconds have passed since the
call began; then it raises :class:`acache.errors.MetaError` with one line naming every
endpoint.  Every call carries gRPC metadata ``hasleader=true``, so a member cut off from the
quorum answers "no leader" at once (watches included) instead of serving stale reads or
hanging: the client moves on.  A failed endpoint's channel is dropped and re-made when the
client comes back to it (gRPC's own reconnect backoff would otherwise keep it refusing calls
for up to minutes after the member is back).

THE RETRY RULE (every mutation must be safe to send twice).  A request whose reply was lost
(a timeout, a member killed mid-call) may have been applied -- even later than the retry: a
proposal stuck in a dying member may still be committed.  So every mutation acache sends must
be one of:

1. *guarded*: its compares fail once it has applied (a ``mod_revision`` compare on a key the
   txn itself puts; a "key absent" compare on a key it creates).  A guarded txn that comes back
   ``succeeded=False`` with ``TxnResult.retried`` set may have been applied by its first
   attempt: the caller finds out from the data (e.g. :mod:`acache.meta.kv_etcd` puts a unique
   stamp in its fence key and reads it back), or treats the attempt as spent (the inode counter
   in :mod:`acache.meta.cluster` re-reads and reserves again: a batch of numbers may be wasted,
   none is handed out twice); or
2. *idempotent while it matters*: puts of fixed values and deletes, on keys that only the
   caller writes, or guarded by a compare that stops a late copy from landing after the caller
   moved on (the KV's intent chunks).

The client itself keeps the rule for what it sends on its own: lease grants choose their lease
ID (a retry finds "lease exists": success), a revoke's retry finds "lease not found" (success),
a compaction's retry finds "already compacted" (success); a keepalive is idempotent.

Compaction.  etcd keeps every revision until it is compacted (and its default 2 GiB quota
then fills and the cluster refuses writes).  :meth:`EtcdClient.start_compactor` compacts
every ``interval`` seconds to the *older* of: the revision ``keep_revisions`` ago (10,000) and
the revision seen ``keep_seconds`` ago (300 s).  Why both: history is needed by watchers that
resume after a failover or a restart of their node (``Watch`` resumes from its last revision;
a member restart or a daemon restart takes seconds to a couple of minutes), so the window must
be long in *time*; at ~1,000 txns/s 10,000 revisions are only 10 s, at 1 txn/s five minutes
are only 300 revisions, so the count keeps a floor for quiet clusters whose watchers fall
behind by revisions rather than by time.  Five minutes at the measured ~1,000 txns/s of small
records is a few hundred MB at most: well inside the quota.  Compaction is logical
(``physical=False``); bbolt reuses the freed pages, so the file stops growing at its steady
state size; shrinking it needs a defragment, which blocks the member and is left to operators.
Several clients compacting is harmless (an older target is "already compacted").

Threads: watches, keepalives and the compactor each run on a daemon thread of their own; the
client's endpoint state is under ``_lock`` (held only to read/advance the endpoint index).
"""
from __future__ import annotations

import logging
import random
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence, Union

from acache.errors import ConfigError, MetaError

try:
    import grpc
    from aetcd.rpc import rpc_pb2 as pb
    from aetcd.rpc import rpc_pb2_grpc as pbg
except ImportError as _e:  # pragma: no cover - depends on the install
    raise ImportError(f"the etcd metadata engine needs grpcio and aetcd ({_e}): "
                      "pip install 'acache[etcd]'") from None

log = logging.getLogger("acache.meta.etcd")

#: etcd's defaults that acache assumes nobody raised (``--max-txn-ops``, ``--max-request-bytes``)
MAX_TXN_OPS = 128
MAX_REQUEST_BYTES = 1536 * 1024
DEFAULT_PORT = 2379
_MD = (("hasleader", "true"),)
_RETRY_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED}
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")


class EtcdError(MetaError):
    """etcd refused a request (not a connectivity problem; retrying will not help)."""

    def __init__(self, msg: str, code: str = ""):
        super().__init__(msg)
        self.code = code


class CompactedError(EtcdError):
    """The revision asked for (a watch's start, a pinned range) was compacted away."""

    def __init__(self, msg: str, compact_revision: int = 0):   # 0: not told
        super().__init__(msg, "OUT_OF_RANGE")
        self.compact_revision = compact_revision


# -- the URL ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class EtcdURL:
    endpoints: tuple[str, ...]
    name: str
    options: dict[str, str] = field(default_factory=dict)

    @property
    def prefix(self) -> bytes:
        return f"/acache/{self.name}/".encode()


def parse_url(url: str) -> EtcdURL:
    """``etcd://h1:2379,h2:2379/NAME[?stall_timeout=30]`` (a host without a port gets 2379)."""
    if not url.startswith("etcd://"):
        raise ConfigError(f"not an etcd URL (etcd://host:port,.../NAME): {url!r}")
    rest = url[len("etcd://"):]
    rest, _, query = rest.partition("?")
    hosts, _, name = rest.partition("/")
    name = name.strip("/")
    if not name or not _NAME_RE.match(name):
        raise ConfigError(f"etcd URL {url!r}: the cluster name (the path) must be one word of "
                          "letters, digits, '.', '_' or '-'")
    eps = []
    for h in hosts.split(","):
        h = h.strip()
        if not h:
            continue
        host, sep, port = h.rpartition(":")
        if not sep:
            host, port = h, str(DEFAULT_PORT)
        if not port.isdigit():
            raise ConfigError(f"etcd URL {url!r}: bad port in {h!r}")
        eps.append(f"{host}:{port}")
    if not eps:
        raise ConfigError(f"etcd URL {url!r} names no endpoint")
    opts = dict(kv.split("=", 1) for kv in query.split("&") if "=" in kv)
    return EtcdURL(tuple(eps), name, opts)


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes [prefix, end) every key starting with ``prefix``."""
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\x00"          # etcd: every key


# -- values crossing the seam ----------------------------------------------------------------
@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0


def _kv(m: Any) -> KeyValue:
    return KeyValue(m.key, m.value, m.create_revision, m.mod_revision, m.version, m.lease)


@dataclass(frozen=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    key: bytes
    range_end: bytes = b""      # b"": the one key

    @staticmethod
    def prefix(p: bytes) -> "Delete":
        return Delete(p, prefix_end(p))


@dataclass(frozen=True)
class Range:
    key: bytes
    range_end: bytes = b""
    limit: int = 0
    keys_only: bool = False

    @staticmethod
    def prefix(p: bytes, limit: int = 0) -> "Range":
        return Range(p, prefix_end(p), limit)


Op = Union[Put, Delete, Range]

_TARGETS = {"version": pb.Compare.VERSION, "create": pb.Compare.CREATE,
            "mod": pb.Compare.MOD, "value": pb.Compare.VALUE}
_RESULTS = {"==": pb.Compare.EQUAL, "!=": pb.Compare.NOT_EQUAL,
            ">": pb.Compare.GREATER, "<": pb.Compare.LESS}


@dataclass(frozen=True)
class Compare:
    """``Compare(key, "mod", "==", 42)``; a missing key compares as revisions/version 0."""
    key: bytes
    target: str             # version | create | mod | value
    result: str             # == != > <
    operand: int | bytes

    @staticmethod
    def mod_revision(key: bytes, rev: int) -> "Compare":
        return Compare(key, "mod", "==", rev)

    @staticmethod
    def version(key: bytes, v: int) -> "Compare":
        return Compare(key, "version", "==", v)

    @staticmethod
    def value(key: bytes, v: bytes) -> "Compare":
        return Compare(key, "value", "==", v)

    @staticmethod
    def absent(key: bytes) -> "Compare":
        return Compare(key, "version", "==", 0)

    def pb(self) -> Any:
        c = pb.Compare(key=self.key, target=_TARGETS[self.target], result=_RESULTS[self.result])
        if self.target == "value":
            assert isinstance(self.operand, bytes)
            c.value = self.operand
        else:
            assert isinstance(self.operand, int)
            setattr(c, {"version": "version", "create": "create_revision",
                        "mod": "mod_revision"}[self.target], self.operand)
        return c


def _op_pb(op: Op) -> Any:
    if isinstance(op, Put):
        return pb.RequestOp(request_put=pb.PutRequest(key=op.key, value=op.value, lease=op.lease))
    if isinstance(op, Delete):
        return pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=op.key,
                                                                       range_end=op.range_end))
    return pb.RequestOp(request_range=pb.RangeRequest(key=op.key, range_end=op.range_end,
                                                      limit=op.limit, keys_only=op.keys_only))


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int                   # the store's revision after the txn (a write: its own)
    responses: list[list[KeyValue] | None]   # per op of the branch taken: a Range's pairs
    retried: bool = False           # sent more than once after an ambiguous failure


@dataclass(frozen=True)
class Event:
    type: str                       # "put" | "delete"
    kv: KeyValue                    # a delete: key and mod_revision (the delete's revision)

    @property
    def revision(self) -> int:
        return self.kv.mod_revision


# -- endpoints -------------------------------------------------------------------------------
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 4 * 1024 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # a partitioned (not killed) member must break long-lived watch streams; etcd's default
    # --grpc-keepalive-min-time is 5 s, so 10 s pings are allowed
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
]


class _Stubs:
    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.kv = pbg.KVStub(channel)
        self.lease = pbg.LeaseStub(channel)
        self.watch = pbg.WatchStub(channel)
        self.maintenance = pbg.MaintenanceStub(channel)


class _Endpoint:
    def __init__(self, target: str) -> None:
        self.target = target
        self._stubs: _Stubs | None = None
        self._lock = threading.Lock()

    def stubs(self) -> _Stubs:
        with self._lock:
            if self._stubs is None:
                self._stubs = _Stubs(grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS))
            return self._stubs

    def reset(self) -> None:
        with self._lock:
            s, self._stubs = self._stubs, None
        if s is not None:
            s.channel.close()


def _retryable(e: grpc.RpcError) -> bool:
    code = e.code()
    if code in _RETRY_CODES:
        return True
    details = (e.details() or "").lower()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "too many requests" in details:
        return True
    return code == grpc.StatusCode.UNKNOWN and ("connection" in details or "socket" in details)


def _describe(e: grpc.RpcError) -> str:
    return f"{e.code().name}: {e.details()}"


# -- the client ------------------------------------------------------------------------------
class EtcdClient:
    def __init__(self, endpoints: Sequence[str], *, prefix: bytes = b"/acache/default/",
                 stall_timeout: float = 30.0, rpc_timeout: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not endpoints:
            raise ConfigError("etcd: no endpoint")
        self.endpoints = tuple(endpoints)
        self.prefix = prefix
        self.stall_timeout = stall_timeout
        self.rpc_timeout = rpc_timeout
        self._clock = clock
        self._eps = [_Endpoint(t) for t in self.endpoints]
        self._cur = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._threads: list[_Background] = []

    @classmethod
    def from_url(cls, url: str, **kw: Any) -> "EtcdClient":
        u = parse_url(url)
        if "stall_timeout" in u.options and "stall_timeout" not in kw:
            kw["stall_timeout"] = float(u.options["stall_timeout"])
        return cls(u.endpoints, prefix=u.prefix, **kw)

    # -- failover ----------------------------------------------------------------------------
    @property
    def current_endpoint(self) -> str:
        with self._lock:
            return self._eps[self._cur].target

    def _current(self) -> tuple[int, _Endpoint]:
        with self._lock:
            return self._cur, self._eps[self._cur]

    def _failover(self, idx: int) -> None:
        with self._lock:
            if self._cur != idx:
                return                  # another thread moved on already
            self._cur = (idx + 1) % len(self._eps)
        self._eps[idx].reset()

    def _attempt(self, op: Callable[[_Stubs, float], Any], stubs: _Stubs, timeout: float) -> Any:
        """One try of an RPC (a seam for fault-injection tests)."""
        return op(stubs, timeout)

    def _call(self, what: str, op: Callable[[_Stubs, float], Any], *,
              mutation: bool = False,
              ok_on_retry: Callable[[grpc.RpcError], bool] | None = None) -> tuple[Any, bool]:
        """Run ``op`` with failover; returns (reply, retried-after-an-ambiguous-failure)."""
        start = self._clock()
        deadline = start + self.stall_timeout
        ambiguous = False
        failures = 0
        last = ""
        while True:
            if self._closed.is_set():
                raise MetaError(f"etcd {what}: the client is closed")
            idx, ep = self._current()
            left = deadline - self._clock()
            try:
                return self._attempt(op, ep.stubs(), max(0.05, min(self.rpc_timeout, left))), ambiguous
            except grpc.RpcError as e:
                if ambiguous and ok_on_retry is not None and ok_on_retry(e):
                    return None, True
                if not _retryable(e):
                    msg = f"etcd {what} at {ep.target}: {_describe(e)}"
                    if e.code() == grpc.StatusCode.OUT_OF_RANGE and "compacted" in (e.details() or ""):
                        raise CompactedError(msg, 0)
                    raise EtcdError(msg, e.code().name)
                last = f"{ep.target}: {_describe(e)}"
                ambiguous = ambiguous or mutation
            failures += 1
            log.debug("etcd %s failed (%s); trying the next endpoint", what, last)
            self._failover(idx)
            left = deadline - self._clock()
            if left <= 0:
                raise MetaError(
                    f"etcd unreachable for {self._clock() - start:.1f}s (stall_timeout "
                    f"{self.stall_timeout:g}s) at {', '.join(self.endpoints)}; last error: {last}")
            if failures % len(self._eps) == 0:      # a whole round failed: back off a little
                self._closed.wait(min(left, 0.05 * 2 ** min(failures // len(self._eps), 4)))

    # -- reads -------------------------------------------------------------------------------
    def get(self, key: bytes, revision: int = 0) -> KeyValue | None:
        req = pb.RangeRequest(key=key, revision=revision)
        r, _ = self._call("get", lambda s, t: s.kv.Range(req, timeout=t, metadata=_MD))
        return _kv(r.kvs[0]) if r.kvs else None

    def range_prefix(self, prefix: bytes, *, revision: int = 0, page: int = 500,
                     keys_only: bool = False) -> Iterator[KeyValue]:
        """Every pair under ``prefix`` in key order, ``page`` keys per request, all pages read
        at one revision (the first page's, or ``revision``): a consistent snapshot."""
        yield from self.range_from(prefix, prefix_end(prefix), revision=revision, page=page,
                                   keys_only=keys_only)

    def range_from(self, start: bytes, end: bytes, *, revision: int = 0, page: int = 500,
                   keys_only: bool = False) -> Iterator[KeyValue]:
        """[start, end) in pages (see :meth:`range_prefix`); halves the page when a reply is
        over the gRPC message limit (big values)."""
        while True:
            req = pb.RangeRequest(key=start, range_end=end, limit=page, revision=revision,
                                  keys_only=keys_only)
            try:
                r, _ = self._call("range", lambda s, t: s.kv.Range(req, timeout=t, metadata=_MD))
            except EtcdError as e:
                if e.code == "RESOURCE_EXHAUSTED" and page > 1:
                    page //= 2
                    continue
                raise
            revision = revision or r.header.revision
            for m in r.kvs:
                yield _kv(m)
            if not r.more or not r.kvs:
                return
            start = r.kvs[-1].key + b"\x00"

    def revision(self) -> int:
        """The cluster's current revision, read linearizably (a barrier: every write
        acknowledged before this call has a revision <= the answer)."""
        req = pb.RangeRequest(key=self.prefix, count_only=True)
        r, _ = self._call("revision", lambda s, t: s.kv.Range(req, timeout=t, metadata=_MD))
        return int(r.header.revision)

    # -- writes ------------------------------------------------------------------------------
    def txn(self, compares: Sequence[Compare], success: Sequence[Op],
            failure: Sequence[Op] = ()) -> TxnResult:
        """One transaction (see the retry rule in the module docstring)."""
        if max(len(compares), len(success), len(failure)) > MAX_TXN_OPS:
            raise EtcdError(f"etcd txn: more than {MAX_TXN_OPS} ops or compares")
        req = pb.TxnRequest(compare=[c.pb() for c in compares],
                            success=[_op_pb(o) for o in success],
                            failure=[_op_pb(o) for o in failure])
        mutation = any(not isinstance(o, Range) for o in (*success, *failure))
        r, retried = self._call("txn", lambda s, t: s.kv.Txn(req, timeout=t, metadata=_MD),
                                mutation=mutation)
        out: list[list[KeyValue] | None] = []
        for resp in r.responses:
            if resp.WhichOneof("response") == "response_range":
                out.append([_kv(m) for m in resp.response_range.kvs])
            else:
                out.append(None)
        return TxnResult(bool(r.succeeded), int(r.header.revision), out, retried)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """An unconditional put (idempotent); returns its revision."""
        req = pb.PutRequest(key=key, value=value, lease=lease)
        r, _ = self._call("put", lambda s, t: s.kv.Put(req, timeout=t, metadata=_MD), mutation=True)
        return int(r.header.revision)

    def delete(self, key: bytes, range_end: bytes = b"") -> int:
        req = pb.DeleteRangeRequest(key=key, range_end=range_end)
        r, _ = self._call("delete", lambda s, t: s.kv.DeleteRange(req, timeout=t, metadata=_MD),
                          mutation=True)
        return int(r.header.revision)

    # -- leases ------------------------------------------------------------------------------
    def lease_grant(self, ttl: float) -> int:
        """A new lease of ``ttl`` seconds (rounded up to whole seconds, at least 2: etcd's
        minimum is about 1.5 x its heartbeat); its ID is chosen here so a retry is exact."""
        lease_id = random.getrandbits(62) + 1
        req = pb.LeaseGrantRequest(TTL=max(2, int(ttl + 0.999)), ID=lease_id)
        exists = lambda e: "lease already exists" in (e.details() or "")
        r, _ = self._call("lease grant", lambda s, t: s.lease.LeaseGrant(req, timeout=t, metadata=_MD),
                          mutation=True, ok_on_retry=exists)
        if r is not None and r.error:
            raise EtcdError(f"etcd lease grant: {r.error}")
        return lease_id

    def lease_keepalive_once(self, lease_id: int) -> int:
        """Refresh the lease; returns its remaining TTL (0: it expired or was revoked)."""
        def op(s: _Stubs, t: float) -> Any:
            stream = s.lease.LeaseKeepAlive(iter([pb.LeaseKeepAliveRequest(ID=lease_id)]),
                                            timeout=t, metadata=_MD)
            try:
                for resp in stream:
                    return resp
            finally:
                stream.cancel()
            raise EtcdError("etcd lease keepalive: no reply")
        r, _ = self._call("lease keepalive", op)
        return int(r.TTL)

    def _done_if(self, what: str, call, already: str) -> None:
        """A mutation whose refusal with ``already`` in the message means it is done (by
        this call's lost first attempt or by someone else): a no-op, not an error."""
        try:
            self._call(what, call, mutation=True,
                       ok_on_retry=lambda e: already in (e.details() or ""))
        except EtcdError as e:
            if already not in str(e):
                raise

    def lease_revoke(self, lease_id: int) -> None:
        req = pb.LeaseRevokeRequest(ID=lease_id)
        self._done_if("lease revoke",
                      lambda s, t: s.lease.LeaseRevoke(req, timeout=t, metadata=_MD), "not found")

    def keepalive(self, lease_id: int, ttl: float,
                  on_lost: Callable[[int], None] | None = None) -> "Keepalive":
        """Keep ``lease_id`` alive from a background thread (every ttl/3 s) until ``stop()``;
        ``on_lost(lease_id)`` runs once if etcd says the lease is gone (expired)."""
        ka = Keepalive(self, lease_id, ttl, on_lost)
        self._start(ka)
        return ka

    # -- watch -------------------------------------------------------------------------------
    def watch_prefix(self, prefix: bytes, start_revision: int,
                     callback: Callable[[list[Event]], None],
                     on_error: Callable[[Exception], None] | None = None) -> "Watch":
        """Deliver every event under ``prefix`` from ``start_revision`` on, in revision order,
        a revision's events together (one call per etcd reply).  Survives failover (resumes
        after the last delivered revision: no event lost or repeated).  Ends with
        ``on_error(e)``: :class:`CompactedError` if the next revision to deliver was compacted,
        :class:`MetaError` if no endpoint answered for ``stall_timeout``, or what the callback
        raised."""
        w = Watch(self, prefix, start_revision, callback, on_error)
        self._start(w)
        return w

    # -- compaction --------------------------------------------------------------------------
    def compact(self, revision: int) -> None:
        """Drop history before ``revision`` (already compacted: a no-op)."""
        req = pb.CompactionRequest(revision=revision, physical=False)
        self._done_if("compact", lambda s, t: s.kv.Compact(req, timeout=t, metadata=_MD),
                      "compacted")

    def start_compactor(self, keep_revisions: int = 10_000, keep_seconds: float = 300.0,
                        interval: float = 60.0) -> "Compactor":
        """Compact periodically (the policy and its reasons: the module docstring)."""
        c = Compactor(self, keep_revisions, keep_seconds, interval)
        self._start(c)
        return c

    def status(self, endpoint: str) -> Any:
        """One member's status (no failover: that member), e.g. ``.leader``, ``.header.member_id``."""
        ep = _Endpoint(endpoint)
        try:
            return ep.stubs().maintenance.Status(pb.StatusRequest(), timeout=self.rpc_timeout)
        finally:
            ep.reset()

    # -- lifecycle ---------------------------------------------------------------------------
    def _start(self, bg: "_Background") -> None:
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(bg)
        bg.start()

    def close(self) -> None:
        for t in self._threads:
            t.stop()
        self._closed.set()
        for t in self._threads:
            t.join(5)
        for ep in self._eps:
            ep.reset()


# -- background threads ----------------------------------------------------------------------
class _Background(threading.Thread):
    def __init__(self, client: EtcdClient, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.client = client
        self._stop_ev = threading.Event()

    def stop(self) -> None:
        self._stop_ev.set()

    @property
    def stopped(self) -> bool:
        return self._stop_ev.is_set()


class Keepalive(_Background):
    def __init__(self, client: EtcdClient, lease_id: int, ttl: float,
                 on_lost: Callable[[int], None] | None) -> None:
        super().__init__(client, f"etcd-keepalive-{lease_id:x}")
        self.lease_id = lease_id
        self.interval = max(0.2, ttl / 3)
        self.on_lost = on_lost
        self.lost = False

    def run(self) -> None:
        while not self._stop_ev.wait(self.interval):
            try:
                ttl = self.client.lease_keepalive_once(self.lease_id)
            except MetaError as e:          # unreachable for stall_timeout: keep trying
                if self.stopped:
                    return
                log.warning("etcd lease %x keepalive: %s", self.lease_id, e)
                continue
            if ttl <= 0:
                self.lost = True
                log.warning("etcd lease %x expired", self.lease_id)
                if self.on_lost is not None and not self.stopped:
                    self.on_lost(self.lease_id)
                return


class _StreamEnded(Exception):
    pass


class Watch(_Background):
    def __init__(self, client: EtcdClient, prefix: bytes, start_revision: int,
                 callback: Callable[[list[Event]], None],
                 on_error: Callable[[Exception], None] | None) -> None:
        super().__init__(client, "etcd-watch")
        self.prefix = prefix
        self.next_revision = start_revision     # the next revision to deliver
        self.callback = callback
        self.on_error = on_error
        self.error: Exception | None = None
        self.created = threading.Event()        # the first stream is established
        self._call_lock = threading.Lock()
        self._stream: Any = None

    def stop(self) -> None:
        super().stop()
        with self._call_lock:
            if self._stream is not None:
                self._stream.cancel()

    def _requests(self, done: threading.Event) -> Iterator[Any]:
        yield pb.WatchRequest(create_request=pb.WatchCreateRequest(
            key=self.prefix, range_end=prefix_end(self.prefix), start_revision=self.next_revision))
        done.wait()             # keep the stream's sending half open until it ends

    def run(self) -> None:
        try:
            self._loop()
        except Exception as e:
            self.error = e
            if not self.stopped:
                (self.on_error or (lambda x: log.error("etcd watch ended: %s", x)))(e)

    def _loop(self) -> None:
        c = self.client
        down_since: float | None = None
        while not self.stopped:
            idx, ep = c._current()
            done = threading.Event()
            try:
                stream = ep.stubs().watch.Watch(self._requests(done), metadata=_MD)
                with self._call_lock:
                    self._stream = stream
                if self.stopped:
                    return
                for resp in stream:
                    down_since = None
                    if resp.compact_revision:
                        raise CompactedError(
                            f"etcd watch of {self.prefix!r} from revision {self.next_revision}: "
                            f"compacted (history starts at {resp.compact_revision})",
                            int(resp.compact_revision))
                    if resp.canceled:
                        raise EtcdError(f"etcd watch canceled: {resp.cancel_reason}")
                    if resp.created:
                        self.created.set()
                    if resp.events:
                        evs = [Event("put" if e.type == 0 else "delete", _kv(e.kv)) for e in resp.events]
                        evs = [e for e in evs if e.revision >= self.next_revision]
                        if evs:
                            self.callback(evs)
                            self.next_revision = evs[-1].revision + 1
                if self.stopped:
                    return
                raise _StreamEnded()            # the server ended the stream: treat as lost
            except (grpc.RpcError, _StreamEnded) as e:
                if self.stopped:
                    return
                if isinstance(e, grpc.RpcError) and not _retryable(e):
                    raise EtcdError(f"etcd watch at {ep.target}: {_describe(e)}", e.code().name)
                now = c._clock()
                down_since = down_since if down_since is not None else now
                if now - down_since > c.stall_timeout:
                    raise MetaError(f"etcd watch: unreachable for {now - down_since:.1f}s at "
                                    f"{', '.join(c.endpoints)}")
                log.info("etcd watch at %s broke; resuming from revision %d on the next endpoint",
                         ep.target, self.next_revision)
                c._failover(idx)
                self._stop_ev.wait(0.05)
            finally:
                done.set()
                with self._call_lock:
                    self._stream = None


class Compactor(_Background):
    def __init__(self, client: EtcdClient, keep_revisions: int, keep_seconds: float,
                 interval: float) -> None:
        super().__init__(client, "etcd-compactor")
        self.keep_revisions = keep_revisions
        self.keep_seconds = keep_seconds
        self.interval = interval
        self.compacted = 0                      # the last revision this compactor compacted to
        self._seen: list[tuple[float, int]] = []

    def target(self, now: float, rev: int) -> int:
        """The revision to compact to: the older of keep_revisions ago and keep_seconds ago."""
        self._seen.append((now, rev))
        old = [r for t, r in self._seen if t <= now - self.keep_seconds]
        if old:     # keep the newest sample older than the window; drop those before it
            self._seen = [(t, r) for t, r in self._seen if r >= old[-1]]
        by_time = old[-1] if old else 0
        return min(rev - self.keep_revisions, by_time)

    def tick(self) -> None:
        rev = self.client.revision()
        tgt = self.target(self.client._clock(), rev)
        if tgt > self.compacted and tgt > 1:
            self.client.compact(tgt)
            self.compacted = tgt
            log.debug("etcd compacted to revision %d (current %d)", tgt, rev)

    def run(self) -> None:
        while not self._stop_ev.wait(self.interval):
            try:
                self.tick()
            except MetaError as e:
                log.warning("etcd compaction: %s", e)
