"""The RDMA transport: bulk data by RDMA READ, everything else on the peer's TCP connection.

An ``RdmaTransport`` is a TCP transport (acache.net.tcp: the handshake, metadata requests,
errors, the fallback) plus, per peer that can, one reliable-connected queue pair.  Nothing
here imports pyverbs until a host is known to have a device (/sys/class/infiniband lists
one); acache.net.rdma_verbs is the one module that touches pyverbs.

Negotiation, per peer, at connect (``transport`` = auto | tcp | rdma):
  1. each side's handshake capabilities say what it has: ``"rdma": {dev, port, state, mtu,
     gids: [IPv4 addresses with a RoCE v2 GID], slot}`` or ``"rdma_off": why``;
  2. RDMA only if we have an active RoCE port with a GID for the local address that routes to
     the peer, the peer advertises "rdma" with a GID for the address we dialed, the peer sets
     up its side (``_rdma.qp``: QPN, PSN, GID, MTU out; its QPN, PSN, GID, the address/rkey of
     its registered buffers, a probe token back; its QP is in RTR/RTS before it answers), our
     QP reaches RTS and a probe READ of the peer's token returns it, all within
     ``negotiate_timeout``;
  3. otherwise TCP, with the reason on ``Conn.path``: "tcp: no RDMA device on this host",
     "tcp: peer has no RDMA device", "tcp: peer: transport = tcp", "tcp: peer has no RoCE v2
     GID for 10.0.0.7", "tcp: RDMA setup failed: ...".  ``transport = tcp`` never negotiates;
     ``transport = rdma`` refuses to start on a host without a usable device (one line) and
     logs a warning, not info, for each peer that ends up on TCP.
  4. any RDMA failure later (a completion error, a post on a QP in the error state, no
     completion within ``timeout``, a READ that outlasts the peer's lease) moves that peer to
     TCP for the rest of the connection, with one log line and Conn.path = "tcp: fell back
     after IBV_WC_RETRY_EXC_ERR at 21:04:11"; the read under way is retried on TCP and returns
     the same bytes.  No RDMA error reaches a caller; TCP errors do, as with TcpTransport.

A read (``read_into``, at least ``rdma_min`` bytes; smaller ones stay inline on TCP, where one
round trip beats a round trip plus a READ):
  client: takes local slots for the buffer (its registered pool), sends the op's request on
          TCP with ``"_rdma": {s: session, cap: buffer length, rel: [leases done]}``;
  server: runs the handler as usual, then preads a FileRegion (or copies bytes) into free
          slots of its registered pool, leases them to the session (``lease`` seconds) and
          answers ``"_rdma": {seg: [[offset, length]...], rel: [lease ids]}`` with no payload
          (no free slot, too small, a short file: the reply goes inline on TCP as before);
  client: READs the segments into its slots, ``piece`` bytes per work request, up to
          ``depth`` in flight on the QP (shared by all threads), copies them into the
          caller's buffer (one memcpy: registering caller buffers per request would cost more
          than the copy; RemoteFile chunk buffers could be pre-registered later), and hands the
          leases back piggybacked on its next request (or they expire).
The server releases a lease only when its session hands it back or it expired; a client that
could not READ within half the lease takes TCP instead (never bytes of a reused slot).

For line rate on real NICs the design has: registered pools on both sides reused across
requests (no registration per request), slots of 4 MiB and 1 MiB READs with 16 in flight per
QP (enough to fill ~100-200 Gb/s at a few us of latency), no copy on the wire path (the NIC
reads the server's slot; the server's pread is from the page cache) and one memcpy on each
side, the TCP request per chunk overlapped by RemoteFile's parallel chunks.

Lock order: RdmaConn._lock, then rdma_verbs' locks; RdmaListener._lock before _Serve.lock.
"""
from __future__ import annotations

import errno
import ipaddress
import itertools
import logging
import os
import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from acache.errors import ConfigError
from acache.net import auth
from acache.net.tcp import TcpConn, TcpTransport
from acache.net.transport import (FileRegion, Handler, ProtocolError, RemoteError, Reply,
                                  TransportError)

if TYPE_CHECKING:
    from acache.net import rdma_verbs as verbs
    from acache.net.tcp_server import TcpListener

log = logging.getLogger("acache.net")

SYSFS = "/sys/class/infiniband"
MODES = ("auto", "tcp", "rdma")
KEY = "_rdma"                          # reserved request/reply meta key
NO_DEVICE = "no RDMA device on this host"


def local_devices() -> list[str]:
    """RDMA devices the kernel lists: the cheap check (no pyverbs) for ``transport = auto``."""
    try:
        return sorted(os.listdir(SYSFS))
    except OSError:
        return []


def _ipv4_of(host: str) -> str:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return str(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])
    if ip.version != 4:
        raise OSError(errno.EAFNOSUPPORT, "IPv6 peer address (RoCE v2 over IPv4 only, for now)")
    return str(ip)


def _source_ip(ip: str) -> str:
    """The local address the kernel routes to ``ip`` from (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, 9))
        return str(s.getsockname()[0])


def _pread_full(fd: int, dst: memoryview, offset: int) -> int:
    got = 0
    while got < len(dst):
        k = os.preadv(fd, [dst[got:]], offset + got)
        if k <= 0:
            break
        got += k
    return got


class RdmaTransport:
    """Settings of both sides (the TCP ones pass through to the TcpTransport underneath)."""
    name = "rdma"

    def __init__(self, secret: bytes | None = None, *, mode: str = "auto", device: str | None = None,
                 slot: int = 4 << 20, serve_slots: int = 16, client_slots: int = 8,
                 piece: int = 1 << 20, depth: int = 16, rdma_min: int = 64 << 10,
                 negotiate_timeout: float | None = None, lease: float | None = None,
                 session_idle: float = 3600.0, **tcp: Any) -> None:
        if mode not in MODES:
            raise ValueError(f"transport {mode!r}: expected one of {', '.join(MODES)}")
        self.mode, self.device = mode, device
        self.tcp = TcpTransport(secret, **tcp)
        self.timeout = self.tcp.timeout
        self.slot, self.serve_slots, self.client_slots = slot, max(1, serve_slots), max(1, client_slots)
        self.piece, self.depth, self.rdma_min = min(piece, slot), max(1, depth), rdma_min
        self.negotiate_timeout = negotiate_timeout or self.tcp.connect_timeout
        self.lease = lease or max(30.0, 3 * self.timeout)
        self.session_idle = session_idle
        self.dev: verbs.Device | None = None
        self.off: str | None = None            # why this host does not do RDMA
        self._probed = False
        self._lock = threading.Lock()
        if mode == "rdma":
            self.probe()
            if self.dev is None:
                raise ConfigError(f"transport = rdma: {self.off}; set transport = auto or tcp")

    @classmethod
    def from_settings(cls, settings, **kw) -> RdmaTransport:
        secret = auth.load_secret(settings.secret_file) if settings.secret_file else None
        mode = getattr(settings, "transport", "auto")
        try:
            return cls(secret, mode=mode, **kw)
        except ConfigError as e:
            raise ConfigError(f"{e} ({settings.source('transport')})") from None

    @property
    def capabilities(self) -> dict:
        self.probe()
        return self.tcp.capabilities

    def probe(self) -> None:
        """Find the device once (pyverbs is imported only when the kernel lists one)."""
        with self._lock:
            if self._probed:
                return
            self._probed = True
            if self.mode == "tcp":
                self.off = "transport = tcp"
            elif not local_devices():
                self.off = f"{NO_DEVICE} ({SYSFS} is empty)" if self.mode == "rdma" else NO_DEVICE
            else:
                try:
                    from acache.net import rdma_verbs
                except ImportError as e:
                    self.off = f"pyverbs cannot be imported ({e}: install Debian's python3-pyverbs)"
                else:
                    try:
                        self.dev = rdma_verbs.Device(self.device)
                    except rdma_verbs.VerbsError as e:
                        self.off = str(e)
            if self.dev is not None:
                self.tcp.capabilities.update(transport="rdma", rdma={**self.dev.info(), "slot": self.slot})
            else:
                self.tcp.capabilities["rdma_off"] = self.off

    def listen(self, address: str) -> RdmaListener:
        self.probe()
        return RdmaListener(self, address)

    def connect(self, address: str) -> RdmaConn:
        self.probe()
        return RdmaConn(self, address)


# ===== the serving side ========================================================================
class _Leases:
    """Slots of the serving pool leased to sessions (pure bookkeeping: the unit tests run it
    without a device).  A slot is free again when its session hands the lease back, closes, or
    the lease expired, and never while the handler is still writing into it."""

    def __init__(self, n: int, slot: int) -> None:
        self.n, self.slot = n, slot
        self.lock = threading.Lock()
        self._free = list(range(self.n))
        self._leases: dict[int, tuple[int, bytes, float]] = {}     # id -> (slot, session, deadline)
        self._filling: set[int] = set()     # leases being written: freed only once written
        self._doomed: set[int] = set()      # ... and handed back (or their session closed) meanwhile
        self._ids = itertools.count(1)

    def take(self, sid: bytes, k: int, lease: float) -> list[tuple[int, int]] | None:
        """``k`` slots leased to ``sid``, as (lease id, offset), in the filling state until
        ``filled``; None if there are not that many free (expired leases are taken back)."""
        now = time.monotonic()
        with self.lock:
            if len(self._free) < k:
                for lid in [lid for lid, (_, _, dl) in self._leases.items()
                            if dl < now and lid not in self._filling]:
                    self._free.append(self._leases.pop(lid)[0])
            if len(self._free) < k:
                return None
            out = []
            for _ in range(k):
                lid, slot = next(self._ids), self._free.pop()
                self._leases[lid] = (slot, sid, now + lease)
                self._filling.add(lid)
                out.append((lid, slot * self.slot))
            return out

    def filled(self, lids: list[int]) -> None:
        with self.lock:
            for lid in lids:
                self._filling.discard(lid)
                if lid in self._doomed:
                    self._doomed.discard(lid)
                    self._end(lid)

    def _end(self, lid: int) -> None:
        """Lock held: the lease is over; its slot is free unless still being written."""
        if lid in self._filling:
            self._doomed.add(lid)
        elif lid in self._leases:
            self._free.append(self._leases.pop(lid)[0])

    def give(self, sid: bytes, lids: object) -> None:
        if not isinstance(lids, list):
            return
        with self.lock:
            for lid in lids:
                got = self._leases.get(lid) if isinstance(lid, int) else None
                if got is not None and got[1] == sid:
                    self._end(lid)

    def give_all(self, sid: bytes) -> None:
        with self.lock:
            for lid in [lid for lid, (_, s, _) in self._leases.items() if s == sid]:
                self._end(lid)


class _Serve(_Leases):
    """The listener's registered pool: ``n`` slots of ``slot`` bytes, then a probe page."""

    def __init__(self, t: RdmaTransport) -> None:
        from acache.net import rdma_verbs as v
        assert t.dev is not None
        super().__init__(t.serve_slots, t.slot)
        self.pd = t.dev.pd()
        try:
            self.region = v.Region(self.pd, self.n * self.slot + 4096, v.SERVE_ACCESS)
        except v.VerbsError:
            self.pd.close()
            raise
        self.probe_off = self.n * self.slot
        self.token = secrets.token_bytes(16)
        self.region.view[self.probe_off:self.probe_off + 16] = self.token

    def close(self) -> None:
        self.region.close()
        try:
            self.pd.close()
        except Exception:              # pyverbs: a PD whose children are gone already
            pass


class _Session:
    __slots__ = ("sid", "ep", "last")

    def __init__(self, sid: bytes, ep: verbs.Endpoint) -> None:
        self.sid, self.ep, self.last = sid, ep, time.monotonic()


class RdmaListener:
    """A TcpListener whose handlers' replies may go out by RDMA READ (see the module notes)."""

    def __init__(self, t: RdmaTransport, address: str) -> None:
        self.t = t
        self.tcp: TcpListener = t.tcp.listen(address)
        self.address = self.tcp.address
        self._lock = threading.Lock()
        self._sessions: dict[bytes, _Session] = {}
        self._serve: _Serve | None = None
        self.off = t.off
        if t.dev is not None:
            from acache.net import rdma_verbs as v
            try:
                self._serve = _Serve(t)
            except v.VerbsError as e:
                self.off = f"cannot register its buffers: {e}"
                log.warning("peer server: RDMA off: %s", self.off)
        self.rdma_replies = self.inline_replies = 0
        self.tcp.register("_rdma.qp", self._qp)
        self.tcp.register("_rdma.close", self._bye, inline=True)

    @property
    def capabilities(self) -> dict:
        return self.tcp.capabilities

    def advertise(self, key: str, value: object) -> None:
        self.tcp.advertise(key, value)

    def register(self, op: str, handler: Handler, *, inline: bool = False) -> None:
        self.tcp.register(op, self._wrap(handler), inline=inline)

    def start(self) -> None:
        self.tcp.start()

    def close(self) -> None:
        self.tcp.close()
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
            serve, self._serve = self._serve, None
        for s in sessions:
            s.ep.close()
        if serve is not None:
            serve.close()

    def counts(self) -> dict:
        with self._lock:
            n = len(self._sessions)
        return {**self.tcp.counts(), "rdma_sessions": n, "rdma_replies": self.rdma_replies,
                "inline_replies": self.inline_replies}

    def _fault(self, kind: str) -> None:
        """Tests: break the RDMA path under the clients ("qp_error": every session's QP to the
        error state; "dereg_mr": the pool's memory region deregistered)."""
        with self._lock:
            sessions = list(self._sessions.values())
        if kind == "qp_error":
            for s in sessions:
                s.ep.to_error()
        elif kind == "dereg_mr" and self._serve is not None:
            self._serve.region.mr.close()
        else:
            raise ValueError(kind)

    # -- the session ops ------------------------------------------------------------------------
    def _qp(self, meta: dict, payload: memoryview) -> dict:
        from acache.net import rdma_verbs as v
        serve, dev = self._serve, self.t.dev
        if serve is None or dev is None:
            raise OSError(errno.EOPNOTSUPP, self.off or "no RDMA here")
        try:
            remote = {k: meta[k] for k in ("qpn", "psn", "gid", "mtu")}
            ip, depth = meta["ip"], meta["depth"]
            if not (all(isinstance(remote[k], int) for k in ("qpn", "psn", "mtu"))
                    and isinstance(remote["gid"], str) and isinstance(ip, str) and isinstance(depth, int)):
                raise TypeError
        except (KeyError, TypeError):
            raise OSError(errno.EINVAL, "malformed queue pair request")
        if ip not in dev.gids:
            raise OSError(errno.EADDRNOTAVAIL, f"no RoCE v2 GID for {ip} here")
        self._reap()
        rd = max(1, min(depth, dev.max_rd_atom, dev.max_init_rd_atom, 16))
        try:
            ep = v.Endpoint(dev, serve.pd, depth=2)
        except v.VerbsError as e:
            raise OSError(errno.EIO, str(e))
        try:
            ep.connect(ip, remote, rd_atomic=rd)          # RTR (and RTS) before we answer
        except v.VerbsError as e:
            ep.close()
            raise OSError(errno.EIO, str(e))
        sid = secrets.token_bytes(16)
        with self._lock:
            if len(self._sessions) >= self.t.tcp.max_conns:
                ep.close()
                raise OSError(errno.EBUSY, f"{len(self._sessions)} RDMA sessions open")
            self._sessions[sid] = _Session(sid, ep)
        return {"s": sid, "qpn": ep.qpn, "psn": ep.psn, "gid": dev.gids[ip][1], "mtu": dev.mtu,
                "addr": serve.region.addr, "rkey": serve.region.rkey, "size": serve.n * serve.slot,
                "probe": serve.probe_off, "token": serve.token, "depth": rd, "lease": self.t.lease}

    def _bye(self, meta: dict, payload: memoryview) -> dict:
        sid = meta.get("s")
        with self._lock:
            s = self._sessions.pop(sid, None) if isinstance(sid, bytes) else None
            serve = self._serve
        if s is not None:
            s.ep.close()
            if serve is not None:
                serve.give_all(s.sid)
        return {}

    def _reap(self) -> None:
        """Sessions unused for ``session_idle`` (a client that vanished without a word)."""
        now = time.monotonic()
        with self._lock:
            gone = [s for s in self._sessions.values() if now - s.last > self.t.session_idle]
            for s in gone:
                del self._sessions[s.sid]
            serve = self._serve
        for s in gone:
            log.info("peer server: RDMA session idle for %gs; closed", self.t.session_idle)
            s.ep.close()
            if serve is not None:
                serve.give_all(s.sid)

    # -- replies by RDMA ------------------------------------------------------------------------
    def _wrap(self, handler: Handler) -> Handler:
        def serve(meta: dict, payload: memoryview) -> Reply | dict:
            want = meta.pop(KEY, None)
            if want is None:
                return handler(meta, payload)
            sess = None
            sid = want.get("s") if isinstance(want, dict) else None
            with self._lock:
                if isinstance(sid, bytes):
                    sess = self._sessions.get(sid)
                pool = self._serve
            if sess is not None and pool is not None:
                sess.last = time.monotonic()
                pool.give(sess.sid, want.get("rel"))
            res = handler(meta, payload)
            reply = res if isinstance(res, Reply) else Reply(meta=res)
            if sess is None or pool is None:
                return Reply({**reply.meta, KEY: "gone"}, reply.payload)
            placed = self._place(pool, sess.sid, reply.payload, want.get("cap"))
            if placed is None:
                self.inline_replies += 1
                return reply
            self.rdma_replies += 1
            return Reply({**reply.meta, KEY: placed}, b"")
        return serve

    def _place(self, pool: _Serve, sid: bytes, payload: bytes | bytearray | memoryview | FileRegion,
               cap: object) -> dict | None:
        """The payload copied into leased slots ({seg, rel}), or None: send it inline."""
        region = payload if isinstance(payload, FileRegion) else None
        src = None if isinstance(payload, FileRegion) else memoryview(payload).cast("B")
        n = region.length if region is not None else len(src)  # type: ignore[arg-type]
        if not isinstance(cap, int) or n == 0 or n < self.t.rdma_min or n > cap:
            return None
        leased = pool.take(sid, -(-n // pool.slot), self.t.lease)
        if leased is None:
            return None
        lids = [lid for lid, _ in leased]
        segs, pos = [], 0
        try:
            for _, off in leased:
                m = min(pool.slot, n - pos)
                dst = pool.region.view[off:off + m]
                if region is not None:
                    got = _pread_full(region.fd, dst, region.offset + pos)
                    if got < m:               # the file is shorter: TCP breaks the frame, as ever
                        pool.give(sid, lids)
                        return None
                else:
                    dst[:] = src[pos:pos + m]  # type: ignore[index]
                del dst
                segs.append([off, m])
                pos += m
        except BaseException:
            pool.give(sid, lids)
            if region is not None and region.release is not None:
                region.release()
            raise
        finally:
            pool.filled(lids)
        if region is not None and region.release is not None:
            region.release()
        return {"seg": segs, "rel": lids}


# ===== the client side =========================================================================
class _Client:
    """Our half of one peer's RDMA path: a PD, a registered pool of slots, a QP, its reads."""

    def __init__(self, t: RdmaTransport, local_ip: str) -> None:
        from acache.net import rdma_verbs as v
        assert t.dev is not None
        self.local_ip = local_ip
        self.slot, self.n = t.slot, t.client_slots
        self.pd = t.dev.pd()
        self.region: verbs.Region | None = None
        self.ep: verbs.Endpoint | None = None
        try:
            self.region = v.Region(self.pd, self.n * self.slot, v.LOCAL_ACCESS)
            self.ep = v.Endpoint(t.dev, self.pd, depth=t.depth)
        except v.VerbsError:
            self.close()
            raise
        self.reads = v.Reads(self.ep, t.depth)
        self._free = list(range(self.n))
        self._cv = threading.Condition()
        self.sid = b""
        self.raddr = self.rkey = self.rsize = 0
        self.lease = t.lease
        self.said_bye = False

    def take(self, k: int, wait: float) -> list[int] | None:
        deadline = time.monotonic() + wait
        with self._cv:
            while len(self._free) < k:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)
            return [self._free.pop() for _ in range(k)]

    def give(self, slots: list[int]) -> None:
        with self._cv:
            self._free.extend(slots)
            self._cv.notify_all()

    def close(self) -> None:
        if self.ep is not None:
            self.ep.to_error()
            deadline = time.monotonic() + 1.0
            while getattr(self, "reads", None) is not None and self.reads.users and time.monotonic() < deadline:
                time.sleep(0.01)
            self.ep.close()
        if self.region is not None:
            self.region.close()
        try:
            self.pd.close()
        except Exception:              # pyverbs: a PD whose children are gone already
            pass


class RdmaConn:
    """The Conn to one peer: its TcpConn, and an RDMA path for reads while that works."""

    def __init__(self, t: RdmaTransport, address: str) -> None:
        self.t, self.address = t, address
        self.tcp: TcpConn = t.tcp.connect(address)
        self.peer_capabilities = self.tcp.peer_capabilities
        self._lock = threading.Lock()
        self._r: _Client | None = None
        self._retired: list[_Client] = []
        self._release: list[int] = []
        self._internal = 0                  # our own TCP requests (not the caller's)
        self.rdma_reads = self.rdma_bytes = self.inline_reads = 0
        try:
            why = self._negotiate()
        except BaseException:
            self.tcp.close()
            raise
        self.path = "rdma" if why is None else f"tcp: {why}"
        if why is not None:
            quiet = t.mode != "rdma" or why.startswith("peer: transport = tcp")
            (log.info if quiet else log.warning)("peer %s: %s", address, self.path)

    # -- negotiation ------------------------------------------------------------------------------
    def _negotiate(self) -> str | None:
        t = self.t
        if t.dev is None:
            return t.off
        peer = self.peer_capabilities.get("rdma")
        if not isinstance(peer, dict):
            off = self.peer_capabilities.get("rdma_off")
            if not isinstance(off, str):
                return "peer speaks TCP only"
            return "peer has no RDMA device" if off.startswith(NO_DEVICE) else f"peer: {off}"
        host, _ = auth.parse_address(self.address)
        try:
            ip = _ipv4_of(host)
            local_ip = _source_ip(ip)
        except OSError as e:
            return f"no RoCE route to {host}: {e.strerror or e}"
        if ip not in (peer.get("gids") or []):
            return f"peer has no RoCE v2 GID for {ip}"
        if local_ip not in t.dev.gids:
            return f"no RoCE v2 GID for the local address {local_ip}"
        from acache.net import rdma_verbs as v
        deadline = time.monotonic() + t.negotiate_timeout
        try:
            r = _Client(t, local_ip)
        except v.VerbsError as e:
            return f"RDMA setup failed: {e}"
        assert r.ep is not None and r.region is not None
        ask = {"qpn": r.ep.qpn, "psn": r.ep.psn, "gid": t.dev.gids[local_ip][1], "mtu": t.dev.mtu,
               "ip": ip, "depth": min(t.depth, t.dev.max_init_rd_atom, t.dev.max_rd_atom)}
        try:
            self._internal += 1
            rep, _ = self.tcp.request("_rdma.qp", ask, timeout=t.negotiate_timeout)
        except RemoteError as e:
            r.close()
            return f"peer could not set up a queue pair: {e}"
        except BaseException:
            r.close()
            raise
        try:
            if not (isinstance(rep.get("s"), bytes) and isinstance(rep.get("token"), bytes)
                    and all(isinstance(rep.get(k), int) for k in
                            ("qpn", "psn", "mtu", "addr", "rkey", "size", "probe", "depth"))
                    and isinstance(rep.get("gid"), str) and isinstance(rep.get("lease"), (int, float))):
                r.sid = rep["s"] if isinstance(rep.get("s"), bytes) else b""
                raise v.VerbsError("malformed queue pair reply")
            r.sid, r.raddr, r.rkey, r.rsize = rep["s"], rep["addr"], rep["rkey"], rep["size"]
            r.lease = float(rep["lease"])
            r.ep.connect(local_ip, rep, rd_atomic=max(1, min(ask["depth"], rep["depth"])))
            r.reads.run([(r.region.addr, r.region.lkey, r.raddr + rep["probe"], 16)], r.rkey, deadline)
            if bytes(r.region.view[:16]) != rep["token"]:
                raise v.VerbsError("the probe READ returned other bytes")
            if time.monotonic() > deadline:
                raise v.VerbsError(f"not ready within {t.negotiate_timeout:g}s")
        except v.VerbsError as e:
            self._bye(r)
            r.close()
            return f"RDMA setup failed: {e}"
        self._r = r
        return None

    def _bye(self, r: _Client) -> None:
        """Tell the peer to drop the session (best effort: it also expires)."""
        if r.said_bye or not r.sid:
            return
        r.said_bye = True
        try:
            with self._lock:
                self._internal += 1
            self.tcp.request("_rdma.close", {"s": r.sid}, timeout=min(2.0, self.t.timeout))
        except TransportError:
            pass

    def _fall_back(self, why: str) -> None:
        with self._lock:
            r, self._r = self._r, None
            if r is None:
                return
            self.path = f"tcp: fell back after {why} at {time.strftime('%H:%M:%S')}"
            self._retired.append(r)
        log.warning("peer %s: RDMA failed (%s); TCP for the rest of this connection", self.address, why)
        if r.ep is not None:
            r.ep.to_error()
        threading.Thread(target=self._bye, args=(r,), name="acache-rdma-bye", daemon=True).start()

    # -- the Conn Protocol ------------------------------------------------------------------------
    def request(self, op: str, meta: dict, payload: bytes | bytearray | memoryview = b"", *,
                timeout: float | None = None) -> tuple[dict, bytes | bytearray]:
        return self.tcp.request(op, meta, payload, timeout=timeout)

    def read_into(self, op: str, meta: dict, buf: memoryview, *, timeout: float | None = None) -> int:
        out = memoryview(buf).cast("B")
        r = self._r
        if r is None or not len(out) or len(out) < self.t.rdma_min:
            return self.tcp.read_into(op, meta, out, timeout=timeout)
        mine = r.take(min(-(-len(out) // r.slot), r.n), wait=min(1.0, self.t.timeout / 4))
        if mine is None:                    # our pool is busy: this one goes inline
            self.inline_reads += 1
            return self.tcp.read_into(op, meta, out, timeout=timeout)
        try:
            return self._rdma_read(r, mine, op, meta, out, timeout)
        finally:
            r.give(mine)

    def _rdma_read(self, r: _Client, mine: list[int], op: str, meta: dict, out: memoryview,
                   timeout: float | None) -> int:
        from acache.net import rdma_verbs as v
        assert r.region is not None
        with self._lock:
            rel, self._release = self._release, []
        t0 = time.monotonic()
        want = {"s": r.sid, "cap": min(len(out), len(mine) * r.slot), "rel": rel}
        try:
            rmeta, n = self.tcp.fetch_into(op, {**meta, KEY: want}, out, timeout=timeout)
        except BaseException:
            with self._lock:
                self._release.extend(rel)   # maybe not seen: offered again (ids are checked there)
            raise
        got = rmeta.get(KEY)
        if got is None:                     # answered inline (small, or the peer's pool is busy)
            self.inline_reads += 1
            return n
        if got == "gone":                   # the payload came inline with it
            self._fall_back("the peer lost the RDMA session")
            return n
        plan = self._plan(r, mine, got)
        if plan is None:
            self._fall_back("a malformed RDMA reply")
            return self.tcp.read_into(op, meta, out, timeout=timeout)
        pieces, total = plan
        if total > len(out):
            with self._lock:
                self._release.extend(got["rel"])
            raise ProtocolError(f"a reply of {total} bytes for a buffer of {len(out)}")
        try:
            r.reads.run([(r.region.addr + lo, r.region.lkey, r.raddr + ro, m) for lo, ro, m, _ in pieces],
                        r.rkey, t0 + (timeout or self.t.timeout))
            if time.monotonic() - t0 > r.lease / 2:
                raise v.VerbsError("a READ slower than half the peer's lease")
        except v.VerbsError as e:
            self._fall_back(str(e))
            return self.tcp.read_into(op, meta, out, timeout=timeout)
        view = r.region.view
        for lo, _, m, bpos in pieces:
            out[bpos:bpos + m] = view[lo:lo + m]
        with self._lock:
            self._release.extend(got["rel"])
            self.rdma_reads += 1
            self.rdma_bytes += total
        return total

    def _plan(self, r: _Client, mine: list[int], got: object) -> tuple[list[tuple[int, int, int, int]], int] | None:
        """Work requests (local offset, remote offset, length, offset in the caller's buffer):
        the segments in order, cut at ``piece`` bytes and at our slots' ends.  None: malformed."""
        if not (isinstance(got, dict) and isinstance(got.get("seg"), list) and isinstance(got.get("rel"), list)):
            return None
        segs = got["seg"]
        if not all(isinstance(s, list) and len(s) == 2 and all(isinstance(x, int) for x in s)
                   and s[0] >= 0 and s[1] > 0 and s[0] + s[1] <= r.rsize for s in segs):
            return None
        if sum(s[1] for s in segs) > len(mine) * r.slot:
            return None
        pieces: list[tuple[int, int, int, int]] = []
        li, used, bpos = 0, 0, 0
        for roff, rlen in segs:
            done = 0
            while done < rlen:
                if used == r.slot:
                    li, used = li + 1, 0
                m = min(rlen - done, r.slot - used, self.t.piece)
                pieces.append((mine[li] * r.slot + used, roff + done, m, bpos))
                done, used, bpos = done + m, used + m, bpos + m
        return pieces, bpos

    def stats(self) -> dict:
        st = self.tcp.stats()
        return {**st, "transport": "rdma" if self._r is not None else "tcp", "path": self.path,
                "requests": st["requests"] - self._internal, "bytes_in": st["bytes_in"] + self.rdma_bytes,
                "rdma_reads": self.rdma_reads, "rdma_bytes": self.rdma_bytes,
                "inline_reads": self.inline_reads}

    def close(self) -> None:
        with self._lock:
            r, self._r = self._r, None
            retired, self._retired = self._retired, []
        if r is not None:
            self._bye(r)
        self.tcp.close()
        for x in ([r] if r is not None else []) + retired:
            x.close()
