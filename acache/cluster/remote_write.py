"""One file's write stream from a cacheless client to its worker (acache.cluster.worker).

    w = RemoteWriter(conn, ino, gen, holder, size, pool=pool)
    w.write(offset, data)      # returns at once, unless ``window`` bytes are unacknowledged
    w.truncate(n); w.fsync() -> {size, mtime_ns}; w.close() -> {size, mtime_ns, ctime_ns}
    w.end()                    # the session is over (best effort)

Writes are copied into a buffer (the caller's memory may be reused at once: a FUSE request
buffer) and coalesced while they are sequential, up to ``piece`` bytes; a full piece (or a
write elsewhere) is sent as one ``data.write`` on the shared ``pool``.  Pipelined, bounded:
at most ``window`` bytes of a file are sent and not yet acknowledged; a write past that
waits (backpressure: a slow worker slows its writers, memory never grows with it).
Ordered as needed: a piece that overlaps one in flight is sent only after that one was
acknowledged, so the worker's bytes are those of the order written; pieces that do not
overlap go out and land in any order.  ``fsync``/``close``/``truncate`` first send what is
buffered and wait for every acknowledgement.

The first failure (the worker died, its disk is full...) fails the file: that and every
later call raise FsError (ENOSPC/EDQUOT as the worker said, else EIO), and nothing more is
sent.  Other files -- other RemoteWriters, to this or to other workers -- are not affected.

Lock: ``_cv`` guards the buffer, the in-flight set and the error; it is never held while a
request is on the wire.
"""
from __future__ import annotations

import errno
import logging
import threading
import time

from acache.errors import FsError
from acache.net.transport import RemoteError, TransportError

log = logging.getLogger("acache.cluster.remote_write")
_PASS_ON = {errno.ENOSPC, errno.EDQUOT}


class RemoteWriter:
    def __init__(self, conn, ino: int, gen: int, holder: str, size: int, *, pool,
                 window: int = 16 << 20, piece: int = 1 << 20) -> None:
        self.conn, self.ino, self.gen, self.holder = conn, ino, gen, holder
        self.pool, self.window, self.piece = pool, max(window, piece), piece
        self.size = size                 # what this client wrote makes the file this long
        self.mtime_ns = time.time_ns()
        self._cv = threading.Condition()
        self._buf = bytearray()
        self._buf_off = 0
        self._inflight: dict[int, tuple[int, int]] = {}   # id -> (offset, end)
        self._ids = 0
        self._bytes = 0                  # unacknowledged bytes sent
        self.error: FsError | None = None
        self.sent = self.acked = 0

    @property
    def _meta(self) -> dict:
        return {"ino": self.ino, "gen": self.gen}

    # -- errors ------------------------------------------------------------------------
    def _fail(self, e: BaseException) -> FsError:
        err = e.errno if isinstance(e, RemoteError) and e.errno in _PASS_ON else errno.EIO
        with self._cv:
            if self.error is None:
                log.error("inode %d: writing to worker %s failed (%s): the file fails with %s",
                          self.ino, self.holder, e, errno.errorcode.get(err, err))
                self.error = FsError(err)
            self._cv.notify_all()
            return self.error

    def _check(self) -> None:
        if self.error is not None:
            raise FsError(self.error.errno)

    # -- the stream --------------------------------------------------------------------
    def write(self, offset: int, data) -> int:
        n = len(data)
        with self._cv:
            self._check()
            if self._buf and offset == self._buf_off + len(self._buf) and \
                    len(self._buf) + n <= self.piece:
                self._buf += data
            else:
                self._send_buf()
                self._buf_off = offset
                self._buf = bytearray(data)
            if len(self._buf) >= self.piece:
                self._send_buf()
            self.size = max(self.size, offset + n)
            self.mtime_ns = time.time_ns()
        return n

    def _send_buf(self) -> None:
        """Send the buffer (lock held): wait for room in the window and for any overlapping
        piece in flight, then hand it to the pool."""
        if not self._buf:
            return
        buf, off = self._buf, self._buf_off
        self._buf = bytearray()
        end = off + len(buf)
        while self.error is None and self._inflight and (
                self._bytes + len(buf) > self.window or
                any(o < end and off < e for o, e in self._inflight.values())):
            self._cv.wait()
        self._check()
        self._ids += 1
        rid = self._ids
        self._inflight[rid] = (off, end)
        self._bytes += len(buf)
        self.sent += len(buf)
        try:
            self.pool.submit(self._send, rid, off, buf)
        except RuntimeError as e:           # the pool is shut down: the mount is going away
            self._inflight.pop(rid, None)
            self._bytes -= len(buf)
            self.error = FsError(errno.EIO)
            raise FsError(errno.EIO) from e

    def _send(self, rid: int, off: int, buf: bytearray) -> None:
        try:
            if self.error is None:
                self.conn.request("data.write", {**self._meta, "offset": off}, buf)
        except (TransportError, OSError) as e:
            self._fail(e)
        except BaseException as e:       # a bug: still never leave a waiter hanging
            self._fail(e)
            raise
        finally:
            with self._cv:
                self._inflight.pop(rid, None)
                self._bytes -= len(buf)
                if self.error is None:
                    self.acked += len(buf)
                self._cv.notify_all()

    def drain(self) -> None:
        """Send what is buffered; return once every piece is acknowledged (FsError if any failed)."""
        with self._cv:
            self._check()
            self._send_buf()
            while self._inflight:
                self._cv.wait()
            self._check()

    def _call(self, op: str, **extra) -> dict:
        try:
            reply, _ = self.conn.request(f"data.{op}", {**self._meta, **extra})
            return reply
        except (TransportError, OSError) as e:
            raise self._fail(e) from None

    # -- what the file system calls --------------------------------------------------------
    def truncate(self, size: int) -> None:
        self.drain()
        self._call("truncate", size=size)
        with self._cv:
            self.size = size
            self.mtime_ns = time.time_ns()

    def fsync(self) -> dict:
        """Durable on the worker: every byte written so far, then the worker's fsync."""
        self.drain()
        return self._call("fsync")

    def close(self) -> dict:
        """Everything acknowledged; the worker's size and times of the file (for the head)."""
        self.drain()
        return self._call("close")

    def end(self) -> None:
        if self.error is not None:       # the worker failed: nothing to end there
            return
        try:
            self.conn.request("data.end", self._meta, timeout=10)
        except (TransportError, OSError) as e:
            log.debug("inode %d: ending the session on %s: %s", self.ino, self.holder, e)
