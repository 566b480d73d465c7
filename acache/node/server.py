"""The control socket: the CLI's requests to the node daemon.

Requests and replies are frames (acache.net.frame): {"op": ..., args...} ->
{"ok": result} | {"error": message, "kind": class name}; `flush` streams
{"progress": {...}} frames before its final reply.  One request per connection.

Bounded: one thread (``serve``) reads every connection's request with a selector, so an
idle or slow client costs a file descriptor and no thread; a request must arrive whole
within ``request_timeout`` and its header may announce at most frame.MAX_REQUEST bytes
(refused before any of the body is read); at most ``max_waiting`` connections wait for
their request (the oldest is closed to make room); at most ``max_clients`` requests run at
once, one thread each (more get a "busy" error).  A malformed request is answered with an
error and one log line.  ``ping`` is answered inline, so liveness checks are never refused.
"""
from __future__ import annotations

import errno
import logging
import math
import os
import selectors
import socket
import threading
import time

from acache.errors import AcacheError
from acache.net import frame

log = logging.getLogger("acache.server")


class _ClientGone(Exception):
    """The client stopped reading (or closed) while we were replying."""


class _Waiting:
    __slots__ = ("sock", "buf", "need", "deadline")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.need: int | None = None     # body size, once the header is in
        self.deadline = deadline


def _bad_args(req: dict) -> str | None:
    """Why a request's arguments cannot be used (None: they can)."""
    if not isinstance(req.get("op"), str):
        return "a request needs an 'op' string"
    for key in ("path", "engine"):
        if key in req and not isinstance(req[key], (str, type(None))):
            return f"{key!r} must be a string"
    if "flush" in req and not isinstance(req["flush"], bool):
        return "'flush' must be true or false"
    t = req.get("timeout")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                          or not math.isfinite(t) or t < 0):
        return f"timeout {t!r}: expected a finite number of seconds >= 0"
    return None


class ControlServer:
    def __init__(self, node, path: str, *, max_clients: int = 64, max_waiting: int = 256,
                 request_timeout: float = 10.0, reply_timeout: float = 60.0) -> None:
        self.node, self.path = node, path
        self.max_clients, self.max_waiting = max_clients, max_waiting
        self.request_timeout, self.reply_timeout = request_timeout, reply_timeout
        if os.path.exists(path):
            os.unlink(path)           # the caller made sure no live daemon owns it
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chmod(path, 0o600)
        self.sock.listen(64)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.active = 0               # requests being served (one thread each)
        self._waiting: dict[socket.socket, _Waiting] = {}   # oldest first
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()   # stop() wakes the reader loop

    # -- the reader loop ------------------------------------------------------------------
    def serve(self) -> None:
        self.sock.setblocking(False)
        self._sel.register(self.sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while not self._stop.is_set():
                for key, _ in self._sel.select(self._next_timeout()):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        continue
                    else:
                        self._read(key.data)
                now = time.monotonic()
                for w in [w for w in self._waiting.values() if w.deadline <= now]:
                    log.debug("control socket: no complete request within %gs; closed",
                              self.request_timeout)
                    self._drop(w)
        finally:
            for w in list(self._waiting.values()):
                self._drop(w)
            self._sel.close()
            self.sock.close()
            self._wake_r.close()
            self._wake_w.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def stop(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:        # already stopped and closed
            pass

    def _next_timeout(self) -> float | None:
        if not self._waiting:
            return None
        first = min(w.deadline for w in self._waiting.values())
        return max(0.0, first - time.monotonic())

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:     # out of file descriptors: make room, never stop serving
                log.warning("control socket: accept failed: %s", os.strerror(e.errno or errno.EIO))
                if self._waiting:
                    self._drop(next(iter(self._waiting.values())))
                else:
                    time.sleep(0.05)
                return
            if len(self._waiting) >= self.max_waiting:
                log.debug("control socket: %d connections without a request; closing the oldest",
                          len(self._waiting))
                self._drop(next(iter(self._waiting.values())))
            conn.setblocking(False)
            w = _Waiting(conn, time.monotonic() + self.request_timeout)
            self._waiting[conn] = w
            self._sel.register(conn, selectors.EVENT_READ, w)

    def _drop(self, w: _Waiting) -> None:
        self._waiting.pop(w.sock, None)
        try:
            self._sel.unregister(w.sock)
        except (KeyError, ValueError):
            pass
        w.sock.close()

    def _read(self, w: _Waiting) -> None:
        want = frame.HEADER - len(w.buf) if w.need is None else \
            min(1 << 16, frame.HEADER + w.need - len(w.buf))
        try:
            data = w.sock.recv(want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:                 # closed before a whole request
            self._drop(w)
            return
        w.buf += data
        try:
            if w.need is None:
                if len(w.buf) < frame.HEADER:
                    return
                w.need = frame.body_size(bytes(w.buf), frame.MAX_REQUEST)
            if len(w.buf) < frame.HEADER + w.need:
                return
            req = frame.decode(bytes(w.buf[frame.HEADER:]))
            why = _bad_args(req)
            if why:
                raise frame.FrameError(why)
        except frame.FrameError as e:
            log.warning("control socket: bad request (%s); answered with an error", e)
            self._answer_inline(w, {"error": f"bad request: {e}", "kind": "AcacheError"})
            return
        self._start(w, req)

    def _answer_inline(self, w: _Waiting, reply: dict) -> None:
        self._waiting.pop(w.sock, None)
        self._sel.unregister(w.sock)
        try:
            w.sock.settimeout(1.0)
            frame.send(w.sock, reply)
        except OSError:
            pass
        w.sock.close()

    def _start(self, w: _Waiting, req: dict) -> None:
        op = req["op"]
        if op == "ping":
            self._answer_inline(w, {"ok": {"pid": os.getpid(), "mountpoint": self.node.mountpoint}})
            return
        with self._lock:
            busy = self.active >= self.max_clients
            if not busy:
                self.active += 1
        if busy:
            log.warning("control socket: %d requests in progress; %r refused", self.max_clients, op)
            self._answer_inline(w, {"error": f"the node is busy ({self.max_clients} requests in "
                                             "progress); try again", "kind": "AcacheError"})
            return
        self._waiting.pop(w.sock, None)
        self._sel.unregister(w.sock)
        try:
            threading.Thread(target=self._handle, args=(w.sock, req), daemon=True).start()
        except RuntimeError:         # cannot start a thread
            with self._lock:
                self.active -= 1
            w.sock.close()

    # -- one request ------------------------------------------------------------------------
    def _send(self, conn: socket.socket, obj: dict) -> None:
        try:
            frame.send(conn, obj)
        except OSError as e:
            raise _ClientGone(os.strerror(e.errno) if e.errno else str(e)) from None

    def _handle(self, conn: socket.socket, req: dict) -> None:
        op = req["op"]
        try:
            with conn:
                conn.setblocking(True)
                conn.settimeout(self.reply_timeout)
                try:
                    result = self._dispatch(op, req, conn)
                    self._send(conn, {"ok": result})
                except _ClientGone:
                    raise
                except AcacheError as e:
                    self._reply_error(conn, e)
                except Exception as e:   # a bug: say so, keep the daemon alive
                    log.exception("control request %r failed", op)
                    self._reply_error(conn, e)
        except _ClientGone as e:
            log.info("control request %r: the client went away (%s)", op, e)
        finally:
            with self._lock:
                self.active -= 1
        if op == "down" and self.node.stopping.is_set():
            self.stop()

    def _reply_error(self, conn, e: Exception) -> None:
        self._send(conn, {"error": str(e) or type(e).__name__, "kind": type(e).__name__})

    def _dispatch(self, op: str, req: dict, conn: socket.socket):
        n = self.node
        if op == "status":
            return n.status(req.get("path"))
        if op == "mount":
            if not req.get("path"):
                raise AcacheError("bad request: mount needs a path")
            return n.mount(req["path"], req.get("engine") or "", req.get("placement") or "")
        if op == "umount":
            return n.umount(req.get("path"))
        if op == "flush":
            def progress(info: dict) -> None:
                self._send(conn, {"progress": info})
            return n.flush(req.get("path"), req.get("timeout"), progress)
        if op == "journal":
            return n.journal(req.get("limit") or 100)
        if op == "journal_skip":
            return n.journal_skip(req["seq"], req.get("reason") or "")
        if op == "down":
            res = n.shutdown(flush=req.get("flush", True), timeout=req.get("timeout"))
            return {**res, "cache_dir": str(n.settings.cache_path)}
        raise AcacheError(f"unknown request {op!r}")
