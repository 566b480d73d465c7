"""The TCP transport: frames (acache.net.wire) over TCP, the handshake of acache.net.auth.

Server (``TcpListener``, in acache.net.tcp_server).  One accept thread; one reader thread per
connection; handlers run on a shared pool of ``workers`` threads and answer out of order, by
request id.  Bounded:
  * at most ``max_pending`` connections in the handshake (the oldest is closed to make room),
    each with ``handshake_timeout`` to finish it; at most ``max_conns`` past it (more are
    refused with EBUSY, which the client sees as PeerUnavailable);
  * a connection with no request for ``idle_timeout`` is closed; a frame, once its first byte
    arrived, must arrive whole within ``frame_timeout`` (slowloris);
  * limits from the header before anything else is read; at most ``max_inflight`` requests
    per connection run at once (then the reader stops reading: TCP pushes back); request
    payloads held in memory are capped server-wide by ``payload_budget``;
  * garbage (bad magic/version/flags, oversize, bad msgpack) drops that connection with
    one log line; everyone else is served on.  An op this node does not serve (a peer of
    another version) fails with ENOSYS, that request only; the connection goes on.
A reply payload may be a FileRegion: header and meta go out with sendmsg, the bytes with
sendfile.  An ``inline`` handler runs on the connection's reader thread (one thread handoff
less: ~30-40 us of a 4 KiB request here), and the connection reads nothing while it runs.

Client (``TcpConn``, one per peer, shared by threads).  A pool of up to ``streams`` TCP
connections, opened as requests overlap (a new one when every open one is busy); with two or
more, one of them is the *control* stream, which carries only requests of at most
CONTROL_PAYLOAD bytes sent by ``request`` (so a namespace call or an fsync never waits behind
bulk writes queued in a busy stream's socket buffer), the others the bulk.  Each is
multiplexed: a reader thread matches replies to waiters by request id and receives a
read_into payload straight into the caller's buffer.  A stream on which nothing arrived for
``timeout`` s while a request waits is declared dead (PeerUnavailable; so a request fails at
most ~2x ``timeout`` after the peer went silent); its waiters fail, the next request opens a
new stream.  No request is retried here: callers decide (reads are idempotent, other ops may
not be).

Lock order: TcpConn._lock before _Stream._lock; _Stream._send_lock is taken alone;
TcpListener._lock before _ServerConn.send_lock.
"""
from __future__ import annotations

import errno
import itertools
import socket
import threading
import time

from acache.net import auth, wire
from acache.net.sock import _TIMEOUTS, _kernel_timeouts, _tune, _why, log
from acache.net.tcp_server import TcpListener
from acache.net.transport import (AuthError, FrameError, PeerUnavailable,
                                  ProtocolError, RemoteError, TransportError)


CONTROL_PAYLOAD = 64 << 10       # a request carrying at most this much goes on the control stream






class TcpTransport:
    """Settings of both sides; ``listen`` and ``connect`` make the objects that do the work."""
    name = "tcp"

    def __init__(self, secret: bytes | None = None, *, timeout: float = 10.0,
                 connect_timeout: float = 5.0, streams: int = 4, max_conns: int = 256,
                 max_pending: int = 64, idle_timeout: float = 300.0, handshake_timeout: float = 5.0,
                 frame_timeout: float | None = None, limits: wire.Limits = wire.Limits(),
                 reply_limit: int = 1 << 30, workers: int = 16, max_inflight: int = 32,
                 payload_budget: int = 512 << 20, sock_buf: int = 4 << 20,
                 caps: dict | None = None) -> None:
        if payload_budget < limits.max_payload:
            raise ValueError("payload_budget must hold at least one max_payload request")
        self.secret = secret
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.streams = max(1, streams)
        self.max_conns, self.max_pending = max_conns, max_pending
        self.idle_timeout, self.handshake_timeout = idle_timeout, handshake_timeout
        self.frame_timeout = timeout if frame_timeout is None else frame_timeout
        self.limits, self.reply_limit = limits, reply_limit
        self.workers, self.max_inflight = workers, max_inflight
        self.payload_budget, self.sock_buf = payload_budget, sock_buf
        self.capabilities = {"version": wire.VERSION, "transport": "tcp", "sendfile": True,
                             "max_payload": limits.max_payload, **(caps or {})}

    @classmethod
    def from_settings(cls, settings, **kw) -> TcpTransport:
        secret = auth.load_secret(settings.secret_file) if settings.secret_file else None
        return cls(secret, **kw)

    def _check_policy(self, address: str, what: str) -> None:
        if self.secret is None and not auth.is_loopback(address):
            raise AuthError(f"{what} {address}: not a loopback address, so a cluster secret is "
                            "required (secret_file)")

    def listen(self, address: str) -> TcpListener:
        self._check_policy(address, "listen")
        return TcpListener(self, address)

    def connect(self, address: str) -> TcpConn:
        self._check_policy(address, "connect to")
        return TcpConn(self, address)


# ===== the client side =======================================================================
class _Pending:
    __slots__ = ("into", "done", "meta", "payload", "n", "error")

    def __init__(self, into: memoryview | None) -> None:
        self.into = into
        self.done = threading.Event()
        self.meta: dict = {}
        self.payload: bytearray = bytearray()
        self.n = 0
        self.error: BaseException | None = None


class _Stream:
    """One TCP connection, multiplexed by request id."""

    def __init__(self, t: TcpTransport, address: str) -> None:
        self.t, self.address = t, address
        host, port = auth.parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=t.connect_timeout)
        except OSError as e:
            raise PeerUnavailable(f"peer {address}: {_why(e)}") from None
        try:
            _tune(sock, t.sock_buf, t.timeout)
            sock.settimeout(t.connect_timeout)
            self.peer_caps = auth.client_handshake(sock, t.secret, t.capabilities)
        except TransportError:
            sock.close()
            raise
        except OSError as e:
            sock.close()
            raise PeerUnavailable(f"peer {address}: handshake: {_why(e)}") from None
        _kernel_timeouts(sock, t.timeout)
        self.sock = sock
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._rids = itertools.count(1)
        self.dead: BaseException | None = None
        self.ctl = False                 # the pool's control stream (TcpConn._pick)
        self.last_rx = self.last_used = time.monotonic()
        self.bytes_in = self.bytes_out = self.requests = 0
        self._reader = threading.Thread(target=self._read_loop, name="acache-peer-rx", daemon=True)
        self._reader.start()

    @property
    def inflight(self) -> int:
        return len(self._pending)

    def fail(self, exc: BaseException) -> None:
        """Declare the stream dead; its reader resolves every waiter as it exits."""
        with self._lock:
            if self.dead is None:
                self.dead = exc
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.fail(PeerUnavailable(f"peer {self.address}: connection closed"))
        self._reader.join(self.t.timeout)
        with self._send_lock:        # no request is being sent on this fd number
            self.sock.close()

    def call(self, op: str, meta: dict, payload, into: memoryview | None,
             timeout: float | None) -> _Pending:
        body = wire.encode_meta([op, meta])
        if len(body) > self.t.limits.max_meta:
            raise ProtocolError(f"request meta of {len(body)} bytes is over the limit")
        plen = memoryview(payload).nbytes
        limit = self.peer_caps.get("max_payload")
        if isinstance(limit, int) and plen > limit:
            raise ProtocolError(f"a payload of {plen} bytes: the peer takes at most {limit}")
        p = _Pending(into)
        with self._lock:
            if self.dead is not None:
                raise PeerUnavailable(str(self.dead))
            rid = next(self._rids)
            if not self._pending:      # the silence clock starts when a request starts waiting
                self.last_rx = time.monotonic()
            self._pending[rid] = p
            self.requests += 1
            self.last_used = time.monotonic()
        try:
            with self._send_lock:
                wire.send_buffers(self.sock, [wire.pack_header(wire.REQUEST, rid, len(body), plen),
                                              body, payload])
            self.bytes_out += plen
        except OSError as e:
            self.fail(PeerUnavailable(f"peer {self.address}: send: {_why(e)}"))
        if not p.done.wait(timeout):
            self.fail(PeerUnavailable(f"peer {self.address}: no reply to {op!r} within {timeout}s"))
            p.done.wait()         # the reader resolves it right after the shutdown
        if p.error is not None:
            raise p.error
        return p

    def _read_loop(self) -> None:
        hdr = bytearray(wire.HEADER)
        limits = wire.Limits(self.t.limits.max_meta, self.t.reply_limit)
        err: BaseException
        try:
            while True:
                try:
                    k = self.sock.recv_into(hdr, wire.HEADER, socket.MSG_WAITALL)
                except BlockingIOError:       # SO_RCVTIMEO: nothing for ``timeout`` s
                    if self._pending and time.monotonic() - self.last_rx >= self.t.timeout:
                        raise PeerUnavailable(f"peer {self.address}: silent for {self.t.timeout}s "
                                              "with requests waiting")
                    continue
                if not k:
                    raise PeerUnavailable(f"peer {self.address}: connection closed")
                self.last_rx = time.monotonic()
                self._recv(memoryview(hdr)[k:])
                h = wire.parse_header(hdr, limits, {wire.REPLY, wire.ERROR})
                meta_raw = bytearray(h.meta_len)
                self._recv(memoryview(meta_raw))
                with self._lock:
                    p = self._pending.get(h.rid)
                if p is None:
                    raise ProtocolError(f"a reply to request {h.rid}, which is not waiting")
                n = h.payload_len
                if h.type == wire.ERROR:
                    d = wire.decode_map(meta_raw)
                    self._skip(n)
                    e = d.get("errno")
                    p.error = RemoteError(e if isinstance(e, int) and e > 0 else errno.EIO,
                                          str(d.get("msg", "")))
                elif p.into is not None and n > len(p.into):
                    self._skip(n)
                    p.error = ProtocolError(f"a reply of {n} bytes for a buffer of {len(p.into)}")
                else:
                    if p.into is not None:
                        self._recv(p.into[:n])
                        p.n = n
                    else:
                        p.payload = bytearray(n)
                        self._recv(memoryview(p.payload))
                        p.n = n
                    self.bytes_in += n
                    try:
                        p.meta = wire.decode_map(meta_raw)
                    except FrameError as e:
                        p.error = e
                with self._lock:
                    self._pending.pop(h.rid, None)
                p.done.set()
        except TransportError as e:
            err = e
        except (BlockingIOError, *_TIMEOUTS):
            err = PeerUnavailable(f"peer {self.address}: nothing received for {self.t.timeout}s")
        except OSError as e:
            err = PeerUnavailable(f"peer {self.address}: {_why(e)}")
        with self._lock:
            if self.dead is None:
                self.dead = err
            err = self.dead        # fail()'s reason first: it came before the reader saw why
            waiting, self._pending = self._pending, {}
        if isinstance(err, ProtocolError):
            log.warning("peer %s: %s; connection dropped", self.address, err)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for p in waiting.values():
            p.error = err
            p.done.set()

    def _recv(self, buf: memoryview) -> None:
        got, n = 0, len(buf)
        while got < n:
            k = self.sock.recv_into(buf[got:], n - got, socket.MSG_WAITALL)
            if not k:
                raise PeerUnavailable(f"peer {self.address}: connection closed mid-reply")
            got += k
            self.last_rx = time.monotonic()

    def _skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            k = min(n, len(scratch))
            self._recv(scratch[:k])
            n -= k


class TcpConn:
    """The Conn to one peer: a pool of multiplexed streams (see the module docstring)."""

    def __init__(self, t: TcpTransport, address: str) -> None:
        self.t, self.address = t, address
        self._lock = threading.Lock()
        self._streams: list[_Stream] = [_Stream(t, address)]   # the first at once: errors now
        self._streams[0].ctl = t.streams >= 2                   # (the control stream)
        self.peer_capabilities = self._streams[0].peer_caps
        idle = self.peer_capabilities.get("idle_timeout")
        self._idle = float(idle) if isinstance(idle, (int, float)) and idle > 0 else t.idle_timeout
        self._closed = False
        self._opened = 1
        self.path = "tcp"

    def _pick(self, bulk: bool) -> _Stream:
        """The stream for the next request.  With ``streams`` >= 2 the pool keeps one
        *control* stream for requests that carry no bulk payload either way (namespace calls,
        write-session opens, fsync, close): they never queue behind megabytes of writes in a
        bulk stream's socket buffer (which held a cacheless client's next open for seconds
        on a saturated link).  Bulk requests share the other ``streams - 1``."""
        with self._lock:
            if self._closed:
                raise PeerUnavailable(f"peer {self.address}: connection closed")
            now = time.monotonic()
            keep = []
            for s in self._streams:
                # a stream idle for half the server's idle timeout is retired before the server
                # closes it under a new request
                if s.dead is None and not (s.inflight == 0 and now - s.last_used > self._idle / 2):
                    keep.append(s)
                else:
                    threading.Thread(target=s.close, daemon=True).start()
            self._streams = keep
            lanes = self.t.streams >= 2
            if lanes and not bulk:
                ctl = next((s for s in keep if s.ctl), None)
                if ctl is not None:
                    return ctl
                pool, cap = [], 1
            elif lanes:
                pool, cap = [s for s in keep if not s.ctl], self.t.streams - 1
            else:
                pool, cap = keep, 1
            best = min(pool, key=lambda s: s.inflight, default=None)
            if best is not None and (best.inflight == 0 or len(pool) >= cap):
                return best
            try:
                s = _Stream(self.t, self.address)
            except PeerUnavailable:
                fallback = best or min(keep, key=lambda s: s.inflight, default=None)
                if fallback is None:
                    raise
                return fallback        # the extra stream is a nicety; use what is open
            s.ctl = lanes and not bulk
            self._streams.append(s)
            self._opened += 1
            return s

    def request(self, op: str, meta: dict, payload: bytes | bytearray | memoryview = b"", *,
                timeout: float | None = None) -> tuple[dict, bytes | bytearray]:
        p = self._pick(len(payload) > CONTROL_PAYLOAD).call(op, meta, payload, None, timeout)
        return p.meta, p.payload

    def read_into(self, op: str, meta: dict, buf: memoryview, *, timeout: float | None = None) -> int:
        return self._pick(True).call(op, meta, b"", memoryview(buf).cast("B"), timeout).n

    def fetch_into(self, op: str, meta: dict, buf: memoryview, *,
                   timeout: float | None = None) -> tuple[dict, int]:
        """read_into that also returns the reply's meta (the RDMA transport's control path)."""
        p = self._pick(True).call(op, meta, b"", memoryview(buf).cast("B"), timeout)
        return p.meta, p.n

    def stats(self) -> dict:
        with self._lock:
            ss = list(self._streams)
        return {"transport": "tcp", "path": self.path,
                "requests": sum(s.requests for s in ss), "bytes_in": sum(s.bytes_in for s in ss),
                "bytes_out": sum(s.bytes_out for s in ss), "streams": len(ss),
                "streams_opened": self._opened}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            ss, self._streams = self._streams, []
        for s in ss:
            s.close()
