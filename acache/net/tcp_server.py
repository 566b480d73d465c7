"""The serving side of the TCP transport (acache.net.tcp has the design notes and the client).

Lock order: TcpListener._lock before _ServerConn.send_lock.
"""
from __future__ import annotations

import errno
import os
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from acache.errors import AcacheError
from acache.net import auth, wire
from acache.net.sock import _TIMEOUTS, _errno_of, _kernel_timeouts, _tune, _why, log
from acache.net.transport import AuthError, FileRegion, FrameError, Handler, Reply, TransportError

if TYPE_CHECKING:
    from acache.net.tcp import TcpTransport


class _Budget:
    """Bytes of request payload the server holds at once (the memory bound)."""

    def __init__(self, total: int) -> None:
        self.free = total
        self._cv = threading.Condition()

    def take(self, n: int, deadline: float) -> bool:
        with self._cv:
            while self.free < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            self.free -= n
            return True

    def give(self, n: int) -> None:
        if n:
            with self._cv:
                self.free += n
                self._cv.notify_all()


_PIECE = 1 << 20
_ZEROS = bytes(_PIECE)


class _Drop(Exception):
    """End this connection (the message is its one log line)."""


class _ServerConn:
    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock, self.peer, self.deadline = sock, peer, deadline
        self.send_lock = threading.Lock()
        self.closed = False

    def shutdown(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class TcpListener:
    def __init__(self, transport: TcpTransport, address: str) -> None:
        self.t = transport
        host, port = auth.parse_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, backlog=512)
        bound = self.sock.getsockname()
        self.address = f"[{bound[0]}]:{bound[1]}" if family == socket.AF_INET6 else f"{bound[0]}:{bound[1]}"
        self.handlers: dict[str, Handler] = {}
        self._extra: dict[str, object] = {}
        self._inline: set[str] = set()
        self._lock = threading.Lock()
        self._pending: dict[_ServerConn, None] = {}     # in the handshake, oldest first
        self._active: set[_ServerConn] = set()
        self._budget = _Budget(transport.payload_budget)
        self._pool = ThreadPoolExecutor(transport.workers, thread_name_prefix="acache-peer-h")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped = 0                                 # connections ended for garbage/timeouts

    @property
    def capabilities(self) -> dict:
        return {**self.t.capabilities, **self._extra, "ops": sorted(self.handlers),
                "idle_timeout": self.t.idle_timeout}

    def advertise(self, key: str, value: object) -> None:
        """One more entry of the handshake this listener answers with (e.g. the namespace
        ops a node serves: ``ns_ops``)."""
        self._extra[key] = value

    def register(self, op: str, handler: Handler, *, inline: bool = False) -> None:
        self.handlers[op] = handler
        if inline:
            self._inline.add(op)
        else:
            self._inline.discard(op)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._accept_loop, name="acache-peer-accept", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(10)
        self.sock.close()
        with self._lock:
            for c in [*self._pending, *self._active]:
                c.shutdown()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def counts(self) -> dict:
        with self._lock:
            return {"pending": len(self._pending), "active": len(self._active), "dropped": self.dropped}

    # -- accepting ---------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        self.sock.settimeout(0.5)     # also the period of the handshake-deadline sweep
        while not self._stop.is_set():
            self._sweep()
            try:
                sock, addr = self.sock.accept()
            except _TIMEOUTS:
                continue
            except OSError as e:
                if self._stop.is_set():
                    return
                log.warning("peer server: accept failed: %s", _why(e))
                with self._lock:
                    self._make_room(force=True)
                time.sleep(0.05)      # out of fds: the oldest handshake was closed; let it go
                continue
            peer = f"{addr[0]}:{addr[1]}"
            conn = _ServerConn(sock, peer, time.monotonic() + self.t.handshake_timeout)
            with self._lock:
                self._make_room()
                self._pending[conn] = None
            try:
                threading.Thread(target=self._serve, args=(conn,), name="acache-peer-conn",
                                 daemon=True).start()
            except RuntimeError:
                log.warning("peer server: cannot start a thread; %s closed", peer)
                with self._lock:
                    self._pending.pop(conn, None)
                sock.close()

    def _make_room(self, force: bool = False) -> None:
        """Close the oldest handshake when too many are under way (lock held)."""
        if len(self._pending) >= self.t.max_pending or (force and self._pending):
            oldest = next(iter(self._pending))
            self._pending.pop(oldest, None)
            log.debug("peer server: %d handshakes under way; %s closed", self.t.max_pending, oldest.peer)
            oldest.shutdown()

    def _sweep(self) -> None:
        now = time.monotonic()
        with self._lock:             # shutdown under the lock: the socket is not closed meanwhile
            for c in [c for c in self._pending if c.deadline <= now]:
                log.info("peer %s: no handshake within %gs; closed", c.peer, self.t.handshake_timeout)
                c.shutdown()

    # -- one connection ------------------------------------------------------------------------
    def _serve(self, c: _ServerConn) -> None:
        sock = c.sock
        try:
            _tune(sock, self.t.sock_buf, self.t.timeout)
            sock.settimeout(self.t.handshake_timeout)
            try:
                auth.server_handshake(sock, self.t.secret, self.capabilities)
            except AuthError as e:
                log.warning("peer %s: refused: %s", c.peer, e)
                return
            except (TransportError, OSError) as e:
                log.info("peer %s: handshake failed: %s", c.peer, e)
                return
            with self._lock:
                was_pending = self._pending.pop(c, "gone") is None
                full = len(self._active) >= self.t.max_conns
                if was_pending and not full:
                    self._active.add(c)
            if not was_pending:
                return
            if full:
                log.warning("peer %s: refused: %d connections open", c.peer, self.t.max_conns)
                auth.refuse(sock, errno.EBUSY, f"{self.t.max_conns} connections open")
                return
            auth.ready(sock)
            _kernel_timeouts(sock, self.t.frame_timeout)   # for the replies (sendmsg, sendfile)
            self._read_requests(c)
        except _Drop as e:
            self.dropped += 1
            log.warning("peer %s: %s; connection dropped", c.peer, e)
        except OSError as e:
            log.info("peer %s: connection lost: %s", c.peer, _why(e))
        finally:
            with self._lock:
                self._pending.pop(c, None)
                self._active.discard(c)
                c.shutdown()
            with c.send_lock:          # no reply is being sent (sendfile holds the fd number)
                sock.close()

    def _skip(self, c: _ServerConn, n: int, deadline: float) -> None:
        """Read and drop ``n`` payload bytes (of a request that is not served)."""
        scratch = memoryview(bytearray(min(n, _PIECE)))
        while n > 0:
            k = min(n, len(scratch))
            self._recv(c, scratch[:k], deadline, "a request's payload")
            n -= k

    def _recv(self, c: _ServerConn, buf: memoryview, deadline: float, what: str) -> None:
        """Fill ``buf`` before ``deadline`` (poll + non-blocking recv: the socket's own timeout
        is the send timeout of the replies)."""
        got, n = 0, len(buf)
        poller = select.poll()
        poller.register(c.sock, select.POLLIN)
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                raise _Drop(f"{what} did not arrive within its timeout")
            try:
                k = c.sock.recv_into(buf[got:], n - got, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                continue
            if not k:
                raise ConnectionError(errno.ECONNRESET, "closed by the peer")
            got += k

    def _read_requests(self, c: _ServerConn) -> None:
        inflight = threading.BoundedSemaphore(self.t.max_inflight)
        hdr = bytearray(wire.HEADER)
        poller = select.poll()
        poller.register(c.sock, select.POLLIN)
        while not c.closed:
            if not poller.poll(self.t.idle_timeout * 1000):
                log.info("peer %s: idle for %gs; closed", c.peer, self.t.idle_timeout)
                return
            deadline = time.monotonic() + self.t.frame_timeout
            try:
                k = c.sock.recv_into(hdr, wire.HEADER, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                continue
            if not k:
                return                                        # closed between requests
            self._recv(c, memoryview(hdr)[k:], deadline, "a frame header")
            try:
                h = wire.parse_header(hdr, self.t.limits, {wire.REQUEST})
                meta_raw = bytearray(h.meta_len)
                self._recv(c, memoryview(meta_raw), deadline, "a request's meta")
                op, meta = wire.decode_request(meta_raw)
            except FrameError as e:
                raise _Drop(str(e))
            handler = self.handlers.get(op)
            if handler is None:
                # a peer of another acache version asking what this one does not serve: that
                # request fails (ENOSYS), the connection and its other requests go on
                self._skip(c, h.payload_len, deadline)
                log.info("peer %s: op %r is not served here: ENOSYS", c.peer, op)
                self._send_error(c, h.rid, errno.ENOSYS, f"op {op!r} is not served by this node")
                continue
            n = h.payload_len
            payload = bytearray()
            try:
                # the payload's memory is taken as its bytes arrive, not as announced: a peer
                # that announces much and sends little holds little
                while len(payload) < n:
                    k = min(n - len(payload), _PIECE)
                    if not self._budget.take(k, deadline):
                        raise _Drop("no memory for the request payload within the frame timeout")
                    have = len(payload)
                    payload.extend(_ZEROS if k == _PIECE else bytes(k))
                    self._recv(c, memoryview(payload)[have:], deadline, "a request's payload")
                if not inflight.acquire(timeout=self.t.frame_timeout):
                    raise _Drop(f"{self.t.max_inflight} requests stuck in handlers")
            except BaseException:
                self._budget.give(len(payload))
                raise
            if op in self._inline:             # cheap: no handoff to a worker thread
                self._run(c, inflight, h.rid, op, handler, meta, payload)
                continue
            try:
                self._pool.submit(self._run, c, inflight, h.rid, op, handler, meta, payload)
            except RuntimeError:                              # the listener is closing
                inflight.release()
                self._budget.give(n)
                return

    def _run(self, c: _ServerConn, inflight: threading.BoundedSemaphore, rid: int, op: str,
             handler: Handler, meta: dict, payload: bytearray) -> None:
        try:
            try:
                res = handler(meta, memoryview(payload))
                reply = res if isinstance(res, Reply) else Reply(meta=res)
                body = wire.encode_meta(reply.meta)
            except (OSError, AcacheError) as e:
                err = _errno_of(e)
                msg = (e.strerror if isinstance(e, OSError) else str(e)) or os.strerror(err)
                self._send_error(c, rid, err, msg)
                return
            except Exception as e:    # a bug in a handler: say so, keep serving
                log.exception("peer %s: handler %r failed", c.peer, op)
                self._send_error(c, rid, errno.EIO, f"{type(e).__name__}: {e}")
                return
            finally:
                self._budget.give(len(payload))
                del payload
            self._send_reply(c, rid, body, reply.payload)
        finally:
            inflight.release()

    def _send_reply(self, c: _ServerConn, rid: int, body: bytes,
                    payload: bytes | bytearray | memoryview | FileRegion) -> None:
        region = payload if isinstance(payload, FileRegion) else None
        try:
            with c.send_lock:
                if c.closed:
                    return
                if region is not None:
                    c.sock.sendall(wire.pack_header(wire.REPLY, rid, len(body), region.length) + body,
                                   socket.MSG_MORE if region.length else 0)
                    wire.send_region(c.sock, region, self.t.frame_timeout)
                else:
                    assert not isinstance(payload, FileRegion)
                    n = memoryview(payload).nbytes
                    wire.send_buffers(c.sock, [wire.pack_header(wire.REPLY, rid, len(body), n), body, payload])
        except OSError as e:       # half a frame may be out: this connection is done
            log.info("peer %s: reply not sent (%s); closed", c.peer, e)
            c.shutdown()
        finally:
            if region is not None and region.release is not None:
                region.release()

    def _send_error(self, c: _ServerConn, rid: int, err: int, msg: str) -> None:
        body = wire.encode_meta({"errno": err, "msg": msg[:512]})
        self._send_reply_raw(c, wire.pack_header(wire.ERROR, rid, len(body)) + body)

    def _send_reply_raw(self, c: _ServerConn, data: bytes) -> None:
        try:
            with c.send_lock:
                if not c.closed:
                    c.sock.sendall(data)
        except OSError:
            c.shutdown()


