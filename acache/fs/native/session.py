"""The /dev/fuse request loop: reader threads, replies, INTERRUPT, and the one error edge.

Each reader thread reads one request at a time from the device (the kernel hands every
request to exactly one reader), runs its handler synchronously and writes the reply with
one writev.  A slow handler (a LOOKUP that lists the under-storage) therefore holds only
its own thread.

Handlers return what to send: bytes or a list of buffers, ``Reply(parts, undo)`` when a
reply that cannot be delivered must be undone (an entry whose lookup count the kernel
never got, an open whose handle it never saw), or ``NO_REPLY`` (FORGET).  Errors are
translated here only: ``FsError(e)`` answers ``-e``; an OSError of the cache disk that
the writer must see (ENOSPC, EDQUOT, EFBIG, EROFS, EIO) answers its errno; anything else is
logged with its traceback and answers EIO.  No exception ends a reader thread.
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import select
import threading
import time
from typing import Callable

from acache.errors import FsError
from acache.fs.native import proto
from acache.fs.opstats import OpStats
from acache.fs.overlap import Overlap
from acache.fs.types import Ctx

log = logging.getLogger("acache.fs.native")

NO_REPLY = object()

# Requests without side effects (or whose side effect a failed reply undoes): when the
# process that asked is being killed, an INTERRUPT for one of them is answered at once
# with EINTR and the late reply dropped (undone), so that the process can die without
# waiting for, say, a listing of the under-storage.  Nobody else ever gets EINTR: stat,
# open or read on a local disk cannot fail that way, and programs do not retry them.
ABORTABLE = frozenset({proto.LOOKUP, proto.GETATTR, proto.READ, proto.READDIR,
                       proto.READDIRPLUS, proto.GETXATTR, proto.LISTXATTR, proto.STATFS,
                       proto.ACCESS})


# OS errors of the cache disk that the writer should see as they are (anything else
# unexpected is a bug: logged with its traceback and answered EIO).
PASS_OS_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class Reply:
    __slots__ = ("parts", "undo")

    def __init__(self, parts, undo: Callable[[], None] | None = None):
        self.parts = parts
        self.undo = undo


class Request:
    __slots__ = ("unique", "opcode", "nodeid", "uid", "gid", "pid", "body")

    def __init__(self, unique, opcode, nodeid, uid, gid, pid, body):
        self.unique = unique
        self.opcode = opcode
        self.nodeid = nodeid
        self.uid = uid
        self.gid = gid
        self.pid = pid
        self.body = body            # memoryview into the reader's buffer: valid until reply

    def ctx(self, umask: int | None = None) -> Ctx:
        if umask is None:
            return Ctx(self.uid, self.gid, self.pid)
        return Ctx(self.uid, self.gid, self.pid, umask)


# Requests the kernel expects no reply to (they are never the target of an INTERRUPT).
UNANSWERED = frozenset({proto.FORGET, proto.BATCH_FORGET, proto.INTERRUPT})
SIGKILL_BIT = 1 << 8                       # bit (SIGKILL - 1) of /proc/<pid>/status SigPnd


class _InFlight:
    __slots__ = ("answered", "pid", "abortable")

    def __init__(self, pid: int, abortable: bool):
        self.answered = False
        self.pid = pid
        self.abortable = abortable


def being_killed(pid: int) -> bool:
    """Is thread ``pid`` being killed (SIGKILL pending: a kill -9, or any fatal signal,
    which the kernel turns into SIGKILL for every thread of the dying process)?"""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith((b"SigPnd:", b"ShdPnd:")):
            try:
                if int(line.split()[1], 16) & SIGKILL_BIT:
                    return True
            except (IndexError, ValueError):
                return False
    return False


class Session:
    """Owns the device fd's request loop; ``handlers`` maps opcode -> handler(Request)."""

    def __init__(self, devfd: int, handlers: dict[int, Callable[[Request], object]], *,
                 threads: int, bufsize: int):
        self.devfd = devfd
        self.handlers = handlers
        self.overlap: Overlap | None = None   # set by the engine (closes in parallel)
        # set by the engine: told of each FLUSH as it is read, before a worker runs it
        self.flush_read: Callable[[Request], None] | None = None
        self.nthreads = max(1, threads)
        self.bufsize = bufsize
        self.ended = threading.Event()
        self._threads: list[threading.Thread] = []
        self._inflight: dict[int, _InFlight] = {}
        self._early: dict[int, int] = {}    # target -> INTERRUPT unique, target not seen yet
        self._lock = threading.Lock()
        self._counts: list[list[int]] = []
        # requests by kind with their latency (acache.node.metrics reads it at scrape time)
        self.stats = OpStats({op: name.lower() for op, name in proto.OPCODE_NAMES.items()})
        self._notices: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._notifier: threading.Thread | None = None
        # told of a handler's unexpected failure (the VFS undoes a half-made metadata change)
        self.on_failure: Callable[[BaseException], object] = lambda e: None

    def _failed(self, e: BaseException) -> None:
        try:
            self.on_failure(e)
        except Exception:
            log.exception("undoing what a failed request changed")

    # --- handshake -------------------------------------------------------------------------

    def handshake(self, negotiate: Callable[[memoryview], tuple[bytes, object]],
                  timeout: float = 10.0):
        """Answer the kernel's INIT (a newer kernel major gets ours, then INIT again)."""
        buf = bytearray(max(self.bufsize, 1 << 20))
        while True:
            ready, _, _ = select.select([self.devfd], [], [], timeout)
            if not ready:
                raise TimeoutError("the kernel sent no FUSE INIT request")
            n = os.readv(self.devfd, [buf])
            length, opcode, unique = proto.IN_HEADER.unpack_from(buf)[:3]
            if opcode != proto.INIT:
                self._write(unique, [proto.out_header(unique, -errno.EIO, 0)])
                continue
            payload, result = negotiate(memoryview(buf)[proto.IN_HEADER.size:min(n, length)])
            self._write(unique, [proto.out_header(unique, 0, len(payload)), payload])
            if result is not None:
                return result

    # --- threads ---------------------------------------------------------------------------

    def start(self, name: str = "acache-fuse") -> None:
        for i in range(self.nthreads):
            counts = [0] * 64
            self._counts.append(counts)
            t = threading.Thread(target=self._run, args=(counts,), name=f"{name}-{i}",
                                 daemon=True)
            self._threads.append(t)
            t.start()

    def drop_pages(self, ino: int) -> None:
        """Ask the kernel to drop its cached pages (and attributes) of ``ino``.  Sent from
        a thread of its own: the kernel waits for the page locks of requests in flight,
        which the reader threads must stay free to answer."""
        if self._notifier is None:
            with self._lock:
                if self._notifier is None:
                    self._notifier = threading.Thread(target=self._notify_loop,
                                                      name="acache-fuse-notify", daemon=True)
                    self._notifier.start()
        self._notices.put(ino)

    def inval_attr(self, ino: int) -> None:
        """Make the kernel drop its cached attributes of ``ino`` now (not its pages: no page
        lock is taken, so this is safe from a request thread, even one serving ``ino``)."""
        body = proto.NOTIFY_INVAL_INODE_OUT
        try:
            os.writev(self.devfd, [proto.out_header(0, proto.NOTIFY_INVAL_INODE, body.size),
                                   body.pack(ino, -1, 0)])
        except OSError as e:   # ENOENT: the kernel does not know the inode (any more)
            if e.errno not in (errno.ENOENT, errno.ENODEV, errno.ECONNABORTED, errno.EBADF):
                log.warning("dropping the kernel's cached attributes of inode %d: %s", ino, e)

    def _notify_loop(self) -> None:
        body = proto.NOTIFY_INVAL_INODE_OUT
        while not self.ended.is_set():
            try:
                ino = self._notices.get(timeout=1.0)
            except queue.Empty:
                continue
            try:
                os.writev(self.devfd, [proto.out_header(0, proto.NOTIFY_INVAL_INODE, body.size),
                                       body.pack(ino, 0, 0)])
            except OSError as e:   # ENOENT: the kernel has forgotten the inode already
                if e.errno in (errno.ENODEV, errno.ECONNABORTED, errno.EBADF):
                    return
                if e.errno != errno.ENOENT:
                    log.warning("dropping the kernel's cached pages of inode %d: %s", ino, e)

    def join(self, timeout: float | None = None) -> bool:
        for t in self._threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self._threads)

    def op_counts(self) -> dict[str, int]:
        """Requests received so far, by opcode name (for tests and status)."""
        total: dict[str, int] = {}
        for counts in self._counts:
            for op, n in enumerate(counts):
                if n:
                    name = proto.OPCODE_NAMES.get(op, str(op))
                    total[name] = total.get(name, 0) + n
        return total

    def _run(self, counts: list[int]) -> None:
        buf = bytearray(self.bufsize)
        mv = memoryview(buf)
        hdr = proto.IN_HEADER
        record = self.stats.shard().record
        clock = time.perf_counter_ns
        seen = self.overlap.seen if self.overlap is not None else None
        flush_read = self.flush_read
        while not self.ended.is_set():
            try:
                n = os.readv(self.devfd, [buf])
            except OSError as e:
                if e.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue
                if e.errno != errno.ENODEV:
                    log.error("reading /dev/fuse: %s; ending the session", e)
                self.ended.set()
                break
            if n < hdr.size:
                continue
            length, opcode, unique, nodeid, uid, gid, pid, _ext, _ = hdr.unpack_from(buf)
            if opcode < 64:
                counts[opcode] += 1
            if seen is not None:
                seen(unique)            # the highest request number read (acache.fs.overlap)
            req = Request(unique, opcode, nodeid, uid, gid, pid, mv[hdr.size:min(n, length)])
            if opcode == proto.FLUSH and flush_read is not None:
                try:
                    flush_read(req)
                except Exception:           # a notice is a nicety: never the reader's end
                    log.exception("FUSE FLUSH: the close-began notice failed")
            t0 = clock()
            try:
                self._dispatch(req)
            except Exception:               # never let a reader die
                log.exception("FUSE %s: unexpected failure in dispatch",
                              proto.OPCODE_NAMES.get(opcode, opcode))
            if opcode < 64:
                record(opcode, clock() - t0)
            if opcode == proto.DESTROY:
                self.ended.set()

    # --- dispatch and replies --------------------------------------------------------------

    def _dispatch(self, req: Request) -> None:
        op = req.opcode
        if op == proto.INTERRUPT:
            self._interrupt(req.unique, proto.INTERRUPT_IN.unpack_from(req.body)[0])
            return
        handler = self.handlers.get(op)
        if handler is None:
            self._send(req, -errno.ENOSYS, ())
            return
        tracked = op not in UNANSWERED
        if tracked:
            self._inflight[req.unique] = _InFlight(req.pid, op in ABORTABLE)   # atomic
            if self._early:
                self._settle_early()
        try:
            try:
                res = handler(req)
            except FsError as e:                  # an answer, not a failure of ours
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("FUSE %s (node %d): %s", proto.OPCODE_NAMES.get(op, op),
                              req.nodeid, errno.errorcode.get(e.errno, e.errno))
                self._send(req, -(e.errno or errno.EIO), ())
                return
            except OSError as e:
                if e.errno in PASS_OS_ERRORS:       # the cache disk is full, read-only...
                    # EFBIG (a truncate or write past the cache disk's maximum file
                    # size) is the caller's doing; the others are the operator's concern
                    log.log(logging.DEBUG if e.errno == errno.EFBIG else logging.WARNING,
                            "FUSE %s (node %d): %s", proto.OPCODE_NAMES.get(op, op),
                            req.nodeid, e)
                    self._failed(e)
                    self._send(req, -e.errno, ())
                    return
                log.exception("FUSE %s (node %d) failed", proto.OPCODE_NAMES.get(op, op),
                              req.nodeid)
                self._failed(e)
                self._send(req, -errno.EIO, ())
                return
            except Exception as e:
                log.exception("FUSE %s (node %d) failed", proto.OPCODE_NAMES.get(op, op),
                              req.nodeid)
                self._failed(e)
                self._send(req, -errno.EIO, ())
                return
            if res is NO_REPLY:
                return
            undo = None
            if isinstance(res, Reply):
                res, undo = res.parts, res.undo
            parts = [res] if isinstance(res, (bytes, bytearray, memoryview)) else res
            if not self._send(req, 0, parts) and undo is not None:
                try:
                    undo()
                except Exception:
                    log.exception("undoing an undelivered %s reply",
                                  proto.OPCODE_NAMES.get(op, op))
        finally:
            if tracked:
                self._inflight.pop(req.unique, None)     # one dict operation: atomic

    def _interrupt(self, unique: int, target: int) -> None:
        """A signal reached the process waiting for ``target`` (see the kernel's
        Documentation/filesystems/fuse.rst, "Interrupting filesystem operations").  The
        request is answered normally unless its work is abandoned (``_abandon``).  An
        INTERRUPT whose request we have not seen yet (another reader thread holds it, not
        yet registered; or it was answered already) is kept until the next request
        arrives, then answered EAGAIN if still unmatched: the kernel queues it again
        (or, for an answered request, ignores the reply)."""
        with self._lock:
            st = self._inflight.get(target)
            if st is None:
                self._early[target] = unique
                return
        self._abandon(target, st)

    def _settle_early(self) -> None:
        with self._lock:
            early, self._early = self._early, {}
        for target, unique in early.items():
            st = self._inflight.get(target)
            if st is not None:
                self._abandon(target, st)
            else:
                self._write(unique, [proto.out_header(unique, -errno.EAGAIN, 0)])

    def _abandon(self, target: int, st: _InFlight) -> None:
        """Answer ``target`` EINTR now if its process is being killed and the request
        can be abandoned (no side effect, or one its undo takes back)."""
        if not st.abortable or st.answered or not being_killed(st.pid):
            return
        with self._lock:
            if st.answered:
                return
            st.answered = True
        self._write(target, [proto.out_header(target, -errno.EINTR, 0)])

    def _send(self, req: Request, error: int, parts) -> bool:
        if req.opcode in ABORTABLE:
            with self._lock:
                st = self._inflight.get(req.unique)
                if st is not None:
                    if st.answered:
                        return False
                    st.answered = True
        size = sum(len(p) for p in parts)
        return self._write(req.unique, [proto.out_header(req.unique, error, size), *parts])

    def _write(self, unique: int, parts: list) -> bool:
        """Write one reply.  A reply the kernel refuses (too many buffers, too large...)
        is answered with EIO instead, so that the caller never waits for ever."""
        if len(parts) > IOV_MAX:                  # writev takes at most IOV_MAX buffers
            parts = [b"".join(parts)]
        try:
            os.writev(self.devfd, parts)
            return True
        except OSError as e:
            if e.errno == errno.ENOENT:       # the request was interrupted / is gone
                return False
            if e.errno in (errno.ENODEV, errno.ECONNABORTED):
                self.ended.set()
                return False
            if parts and len(parts[0]) >= proto.OUT_HEADER.size \
                    and proto.OUT_HEADER.unpack_from(parts[0])[1] != 0:
                log.error("writing the error reply to request %d: %s", unique, e)
                return False
            log.error("writing the reply to request %d: %s; answering it EIO", unique, e)
        try:
            os.writev(self.devfd, [proto.out_header(unique, -errno.EIO, 0)])
        except OSError as e:
            if e.errno in (errno.ENODEV, errno.ECONNABORTED):
                self.ended.set()
            elif e.errno != errno.ENOENT:
                log.error("answering request %d EIO: %s", unique, e)
        return False
