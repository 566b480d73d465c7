"""ClientVFS: what a cluster node's mount serves (every node's, the head's included).

Namespace operations go to the head (acache.cluster.head) -- a call on the head itself, a
request over the peer transport elsewhere.  Bytes never do: a file opened for writing gets
a generation of its own on this node (the head hands out the number), written in this
node's cache directory at disk speed; close() asks the head to journal it, fsync() makes it
durable here and records its size at the head.  Reading a file comes from this node's cache
if it holds that generation, else from the holder's cache over the peer transport (fetched
chunk by chunk with read-ahead and served from the fetched chunk in memory, while a local copy
is written behind: acache.data.readthrough; the copy may leave chunks out rather than hold a
reader to this disk's speed, and counts as whole only once every chunk is written), or from
the under-storage once it is persisted and no cache holds it any more.

Consistency across nodes is close-to-open: a file closed on A reads whole on B from an open
that starts after the close returned (the open asks the head which generation is current);
names and attributes on B's kernel are cached for ``ENTRY_TIMEOUT`` (1 s) at most.  An open
on B of a file open for writing on A reads what A's cache file holds at each read (no copy is
kept: that generation is not finished); its size is what A's last fsync or close recorded.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from acache.errors import FsError, NewFile, UnderStoreError
from acache.cluster.remote_ns import RemoteNamespace, _ctx
from acache.fs.files import _libc, check_fallocate
from acache.fs.types import STATE_XATTR, Attr

if TYPE_CHECKING:
    from acache.net.transport import Conn

log = logging.getLogger("acache.cluster.client")
ENTRY_TIMEOUT = 1.0
UNREACHABLE_FOR = 5.0     # s: a holder that failed a read fails the next ones at once
# reader(offset, n): n bytes of a generation from where it is (a peer's buffer is handed on
# as it came, a bytearray: no copy of a whole chunk)
Reader = Callable[[int, int], bytes | bytearray]


@dataclass
class _Handle:
    fh: int
    ino: int
    gen: int
    fd: int
    writable: bool
    size: int = 0
    complete: bool = True         # the local cache file holds the whole generation
    reader: Reader | None = None
    closed: bool = False
    append: bool = False          # O_APPEND: every write lands at the end of what is here
    live: bool = False            # a generation another node is writing: read from it, no copy


@dataclass
class _Writing:
    gen: int
    fd: int
    handles: set = field(default_factory=set)     # write handles not yet released
    active: set = field(default_factory=set)      # ... not yet closed (FLUSH)
    direct: bool = False          # the kernel writes its cache file itself (passthrough)
    sig: tuple = ()               # (size, mtime_ns) the last close sent to the head


class ClientVFS(RemoteNamespace):
    """A cluster node's open files, over the head's namespace (RemoteNamespace)."""

    def __init__(self, node_id: str, cache, under, ns: Callable[..., dict],
                 peer: Callable[[str], Conn], *, chunk_size: int = 8 << 20,
                 incarnation: Callable[[str], object] | None = None,
                 announce: Callable[[], str] | None = None) -> None:
        from acache.data.readthrough import ReadThrough
        super().__init__(ns, cache)
        self.node_id = node_id
        self.under = under
        self.peer = peer                   # node id -> Conn
        # lag_ok: a copy here of a file another node holds is a cache for re-reads; a reader
        # is not held to this disk's write speed to keep it whole (a chunk left out is
        # fetched again when read again)
        self.fetch = ReadThrough(under, chunk_size, cache=cache, lag_ok=True)
        self._handles: dict[int, _Handle] = {}
        self._fh = 0
        self._wopen: dict[int, _Writing] = {}
        self._complete: set[tuple[int, int]] = set()   # local copies known whole
        self._drop_later: set[tuple[int, int]] = set()
        self._ino_locks: dict[int, threading.Lock] = {}
        # holder -> (monotonic time it is tried again, its incarnation when it failed)
        self._unreachable: dict[str, tuple[float, object]] = {}
        # incarnation(node): a value that changes when the node restarts, None while it is
        # down or unknown (acache.cluster.member: the value of its alive key, a lease id)
        self.incarnation = incarnation
        # announce(): tell the head a close began here, returning the token the close then
        # carries (acache.cluster.member.Member.announce); FUSE request number -> token
        self.announce = announce
        self._began: dict[int, str] = {}
        self._began_lock = threading.Lock()
        cache.attach(self)

    # -- what the remote namespace asks of the open files here (RemoteNamespace) ---------
    def _overlay(self, a: Attr) -> Attr:
        # under the lock: the last release takes the session out of _wopen under it before
        # the cache closes the fd (else fstat of a closed -- or reused -- descriptor)
        with self.lock:
            w = self._wopen.get(a.ino)
            s = os.fstat(w.fd) if w is not None else None
        if s is not None:       # written here now: the cache file's size and times are the file's
            a.size, a.blocks = s.st_size, s.st_blocks
            a.mtime_ns, a.ctime_ns = max(a.mtime_ns, s.st_mtime_ns), max(a.ctime_ns, s.st_ctime_ns)
        return a

    def _mtime_set_here(self, ino: int, atime_ns: int | None, mtime_ns: int) -> None:
        w = self._wopen.get(ino)
        if w is not None:    # keep fstat-based answers in step while it is written here
            os.utime(w.fd, ns=(atime_ns if atime_ns and atime_ns > 0 else mtime_ns, mtime_ns))

    def getxattr(self, ino: int, name: bytes) -> bytes:
        # the kernel asks for security.capability at a file's first write: no xattr is stored
        # anywhere (the namespace's only one is the computed state), and a file open for
        # writing here exists, so that answer needs no call to the head -- one round trip per
        # file written
        if name != STATE_XATTR and ino in self._wopen:
            raise FsError(errno.ENODATA)
        return super().getxattr(ino, name)

    # -- handles ----------------------------------------------------------------------------
    def handle_ino(self, fh: int) -> int | None:
        h = self._handles.get(fh)
        return h.ino if h is not None else None

    def is_open(self, ino: int) -> bool:
        return any(h.ino == ino for h in list(self._handles.values()))

    def passthrough_fd(self, fh: int, opening: bool = False) -> int | None:
        """The cache fd the kernel may read and write directly for ``fh`` (FUSE passthrough),
        or None: every byte through the daemon.  Writes: the size and mtime the head needs
        come from fstat of the cache file at each close and fsync, as on one host; an
        O_APPEND handle stays served (its end is this node's copy, not the kernel's idea),
        and near the cache limit a new write open is served, whose writes wait for room.
        Reads: served by the daemon (see below)."""
        with self.lock:
            h = self._handles.get(fh)
            if h is None or h.live or h.fd < 0:
                return None
            if h.writable:
                w = self._wopen.get(h.ino)
                if h.append or w is None or (opening and not self.cache.roomy()):
                    return None
                w.direct = True
                return h.fd
            # reads stay served: every write open in a cluster is a new generation, and the
            # kernel allows one backing file per inode -- a reader passed through to the old
            # generation would turn the next write open here away (EBUSY) or, served, into
            # the old file
            return None

    def journal_unjournaled(self) -> list[int]:
        return []

    def _handle(self, fh: int) -> _Handle:
        h = self._handles.get(fh)
        if h is None:
            raise FsError(errno.EBADF)
        return h

    def _new(self, h: _Handle) -> int:
        with self.lock:
            self._fh += 1
            h.fh = self._fh
            self._handles[h.fh] = h
            return h.fh

    def _reader(self, src: dict, ino: int) -> Reader | None:
        """Where the bytes of generation ``src`` come from when this node has no copy."""
        holder, gen = src.get("holder", ""), src["gen"]
        upath = src.get("upath")
        if src.get("cached") and holder and holder != self.node_id:
            # the under-storage holds this very generation (the head said so): a holder that
            # does not answer is not the end of the read
            persisted = upath if src.get("persisted") else None

            def from_peer(off: int, n: int) -> bytes | bytearray:
                from acache.net.transport import PeerUnavailable, TransportError
                if self._shunned(holder):
                    # it just failed a request (the transport waited its whole timeout then):
                    # the next chunks, and the kernel's re-reads, fail at once instead of
                    # each waiting that long again
                    if persisted is not None and self._still_there(ino, gen, persisted):
                        return self.under.read(persisted, off, n)
                    raise FsError(errno.EIO, f"reading inode {ino}: its holder {holder} did "
                                  "not answer a moment ago")
                try:
                    conn = self.peer(holder)
                    buf = self.fetch.buffer(n)
                    got = conn.read_into("data.read", {"ino": ino, "gen": gen, "offset": off,
                                                       "length": n}, memoryview(buf))
                except PeerUnavailable as e:
                    self._unreachable[holder] = (time.monotonic() + UNREACHABLE_FOR,
                                                 self._incarnation(holder))
                    if persisted is not None and self._still_there(ino, gen, persisted):
                        log.warning("reading inode %d from %s failed: %s; reading it from the "
                                    "under-storage (%s)", ino, holder, e, persisted)
                        return self.under.read(persisted, off, n)
                    log.error("reading inode %d from %s failed: %s (EIO; its reads fail at once "
                              "for %.0f s, or until it restarts)", ino, holder, e, UNREACHABLE_FOR)
                    raise FsError(errno.EIO, str(e)) from None   # not retried: it timed out
                except TransportError as e:
                    raise UnderStoreError(f"reading inode {ino} from {holder}: {e}",
                                          retryable=getattr(e, "retryable", False)) from None
                self._unreachable.pop(holder, None)
                return buf if got == n else bytes(buf[:got])    # no copy of a whole chunk
            return from_peer
        if src.get("cached") and holder == self.node_id and src.get("writing") \
                and self.cache.exists(ino, gen):
            # a cacheless client writes it into this worker's cache now: read what is there
            path = self.cache.path(ino, gen)

            def from_here(off: int, n: int) -> bytes:
                with open(path, "rb", buffering=0) as f:
                    return os.pread(f.fileno(), n, off)
            return from_here
        if upath is not None:
            return lambda off, n: self.under.read(upath, off, n)
        return None

    def _still_there(self, ino: int, gen: int, upath: str) -> bool:
        """Whether the under-storage still holds generation ``gen`` of ``ino`` at ``upath``
        (asked of the head before each such read: since the open, another file may have
        been renamed over that path and persisted, or the file rewritten)."""
        try:
            src = self.ns("source", ino=ino)
        except (FsError, UnderStoreError) as e:
            log.debug("inode %d: where its generation %d is: %s", ino, gen, e)
            return False
        return bool(src.get("persisted")) and src.get("gen") == gen and src.get("upath") == upath

    def _incarnation(self, node: str) -> object:
        if self.incarnation is None:
            return None
        try:
            return self.incarnation(node)
        except Exception as e:           # etcd away: as if nothing changed
            log.debug("the incarnation of %s is unknown: %s", node, e)
            return None

    def _shunned(self, holder: str) -> bool:
        """Whether reads from ``holder`` fail at once: it failed one a moment ago and has
        not restarted since (a restarted holder is asked again at once)."""
        until, inc = self._unreachable.get(holder, (0.0, None))
        if time.monotonic() >= until:
            return False
        now = self._incarnation(holder)
        if now is not None and now != inc:
            self._unreachable.pop(holder, None)
            return False
        return True

    def _local_whole(self, ino: int, gen: int, size: int, holder: str) -> bool:
        if (ino, gen) in self._complete:
            return True
        if holder == self.node_id and self.cache.exists(ino, gen) and \
                os.stat(self.cache.path(ino, gen)).st_size >= size:
            self._complete.add((ino, gen))
            return True
        return False

    def _copy(self, ino: int, gen: int, src: dict) -> None:
        """Fill generation ``gen`` (just created, empty) with generation ``src`` of the file."""
        old = src["gen"]
        try:
            if self._local_whole(ino, old, src["size"], src.get("holder", "")):
                self.cache.clone(ino, old, gen)
                return
            reader = self._reader(src, ino)
            if reader is None:
                raise FsError(errno.EIO, f"no copy of inode {ino} generation {old} is reachable")
            fd = self.cache.acquire(ino, gen, write=True)
            try:
                self.fetch.fetch_all(ino, gen, fd, lambda: src.get("upath") or f"inode {ino}",
                                     src["size"], reader=reader)
                self.fetch.forget(ino, gen)
            finally:
                self.cache.release(ino, gen, write=True)
        finally:
            self.ns("copied", ino=ino, gen=old)

    def _ino_lock(self, ino: int) -> threading.Lock:
        """Held across a write open's or its last release's call to the head, so that the
        head's one write session per node and this node's handles stay in step."""
        with self.lock:
            lk = self._ino_locks.get(ino)
            if lk is None:
                lk = self._ino_locks[ino] = threading.Lock()
            return lk

    def _open_write(self, ino: int, r: dict) -> int:
        gen = r["gen"]
        with self.lock:
            w = self._wopen.get(ino)
            fresh = not r.get("same") and (w is None or w.gen != gen)
        fd: int | None = None
        if fresh:
            try:
                if r.get("src"):
                    self.cache.create_empty(ino, gen)
                    self._copy(ino, gen, r["src"])
                else:            # created empty by the open its handle keeps (one open, not two)
                    fd = self.cache.acquire(ino, gen, write=True, empty=True)
            except BaseException:
                self.ns("end_write", ino=ino, gen=gen)
                raise
        elif w is None and not self.cache.exists(ino, gen):
            # the head lets this node write its own generation in place, which is not here
            self.ns("end_write", ino=ino, gen=gen)
            log.error("open of inode %d for writing: its generation %d is not in this node's "
                      "cache", ino, gen)
            raise FsError(errno.EIO)
        elif r.get("trunc"):
            os.truncate(self.cache.path(ino, gen), 0)   # O_TRUNC of what this node writes
        if fd is None:
            fd = self.cache.acquire(ino, gen, create=True, write=True)
        self.cache.note(ino, gen, dirty=True)
        h = _Handle(0, ino, gen, fd, True)
        fh = self._new(h)
        with self.lock:
            if ino not in self._wopen:
                self._wopen[ino] = _Writing(gen, fd)
            w = self._wopen[ino]
            w.handles.add(fh)
            w.active.add(fh)
            self._complete.add((ino, gen))
        return fh

    def _copy_max(self) -> int | None:
        """The largest file this cache copies into a new generation rather than have it
        written in place (schema.OpenWrite.copy_max): any size with reflinks."""
        return None if self.cache.cheap_clone(1 << 62) else self.cache.CLONE_MAX

    def create(self, parent: int, name: bytes, mode: int, flags: int, ctx) -> tuple[int, Attr]:
        self.cache.wait_for_room()
        self._changed()
        r = self.ns("create", parent=parent, name=name, mode=mode, flags=flags, ctx=_ctx(ctx),
                    copy_max=self._copy_max())
        self._dir_after_create(parent, r)
        r["trunc"] = bool(flags & os.O_TRUNC)
        with self._ino_lock(r["ino"]):
            fh = self._open_write(r["ino"], r)
        return fh, self._overlay(self._attr(r["attr"]))

    def open(self, ino: int, flags: int, ctx=None, same_file: bool = False) -> int:
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        if writable:
            if same_file:
                raise NewFile()    # the head may give it a new generation: not promised
            self.cache.wait_for_room()
            trunc = bool(flags & os.O_TRUNC)
            with self._ino_lock(ino):
                r = self.ns("open_write", ino=ino, trunc=trunc, copy_max=self._copy_max())
                r["trunc"] = trunc
                fh = self._open_write(ino, r)
            self._handles[fh].append = bool(flags & os.O_APPEND)
            return fh
        with self.lock:
            w = self._wopen.get(ino)
            if w is not None:            # written here: read what is being written
                fd = self.cache.acquire(ino, w.gen)
                return self._new(_Handle(0, ino, w.gen, fd, False))
        r = self.ns("open_read", ino=ino)
        gen, size = r["gen"], r["size"]
        if r.get("writing") and size:
            # another node writes this generation now: its bytes change under a copy, so a
            # copy here would be read later as the generation's whole bytes -- read from the
            # writer each time instead (what it has now; the close-to-open rule promises no more)
            reader = self._reader(r, ino)
            if reader is None:
                self.ns("end_read", ino=ino, gen=gen)
                raise FsError(errno.EIO, f"no copy of inode {ino} is reachable")
            return self._new(_Handle(0, ino, gen, -1, False, size=size, complete=False,
                                     reader=reader, live=True))
        try:
            whole = size == 0 or self._local_whole(ino, gen, size, r.get("holder", ""))
            reader = None if whole else self._reader(r, ino)
            if not whole and reader is None:
                raise FsError(errno.EIO, f"no copy of inode {ino} is reachable")
            fd = self.cache.acquire(ino, gen, create=True)
            self.cache.touch(ino)
        except BaseException:
            self.ns("end_read", ino=ino, gen=gen)
            raise
        if not whole and (ino, gen) not in self._complete:
            self.cache.note(ino, gen, dirty=False, size=0)
        return self._new(_Handle(0, ino, gen, fd, False, size=size, complete=whole, reader=reader))

    # -- data ----------------------------------------------------------------------------------
    def read(self, fh: int, offset: int, size: int) -> bytes | bytearray:
        h = self._handle(fh)
        if h.live:
            assert h.reader is not None       # a live handle is opened with its reader
            n = max(0, min(size, h.size - offset))
            return h.reader(offset, n) if n else b""
        if not h.complete and (h.ino, h.gen) not in self._complete:
            got = self._fetched(h, offset, size, True)
            assert got is not None
            return got
        return os.pread(h.fd, size, offset)

    def _fetched(self, h: _Handle, offset: int, size: int, wait: bool):
        """A read of a generation this node is copying: the fetcher serves it (from the
        chunk just fetched, in memory, while its copy is written behind) and fetches ahead.
        None (``wait=False``) if that would wait for a fetch."""
        n = max(0, min(size, h.size - offset))
        if n == 0:
            return b""
        got = self.fetch.read(h.ino, h.gen, h.fd, lambda: f"inode {h.ino}", h.size, offset, n,
                              reader=h.reader, wait=wait)
        if got is None:
            return None
        data, whole = got
        if whole:
            with self.lock:
                self._complete.add((h.ino, h.gen))
            h.complete = True
        return data

    def read_fast(self, fh: int, offset: int, size: int):
        h = self._handles.get(fh)
        if h is None or h.live:
            return None
        if not (h.complete or (h.ino, h.gen) in self._complete):
            return self._fetched(h, offset, size, False)   # fetched already: no thread hop
        return os.pread(h.fd, size, offset)

    def write(self, fh: int, offset: int, data) -> int:
        h = self._handle(fh)
        if not h.writable:
            raise FsError(errno.EBADF)
        if h.closed:
            self._written_after_close(h)
        if h.append:
            return self._append(h, data)
        n = os.pwrite(h.fd, data, offset)
        self.cache.grow(h.ino, h.gen, offset + n)
        return n

    def _written_after_close(self, h: _Handle) -> None:
        """A FLUSH came from a close(2) of a copy of the descriptor (a fork + exec closes the
        child's copy, a dup) and the file is written on: it is open again.  The head cancels
        what that close journaled and has not started persisting (its bytes are not the
        file's content); the next FLUSH journals it again."""
        with self.lock:
            if not h.closed:
                return
            h.closed = False
            w = self._wopen.get(h.ino)
            if w is not None:
                w.active.add(h.fh)
        self.ns("reopen", ino=h.ino, gen=h.gen)

    def _append(self, h: _Handle, data) -> int:
        """O_APPEND: the kernel's offset is its cached size, which another host's close may
        have made stale; the end of the file is the end of this node's copy."""
        with self._ino_lock(h.ino):
            offset = os.fstat(h.fd).st_size
            n = os.pwrite(h.fd, data, offset)
        self.cache.grow(h.ino, h.gen, offset + n)
        return n

    def write_fast(self, fh: int, offset: int, data) -> int | None:
        h = self._handles.get(fh)
        if h is None or not h.writable or h.append or h.closed or not self.cache.has_room(len(data)):
            return None
        n = os.pwrite(h.fd, data, offset)
        self.cache.account(h.ino, h.gen, offset + n)
        return n

    def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        punch = check_fallocate(mode, offset, length)
        h = self._handle(fh)
        if not h.writable:
            raise FsError(errno.EBADF)
        if h.closed:
            self._written_after_close(h)
        import ctypes
        if _libc.fallocate(h.fd, mode, offset, length) != 0:
            raise FsError(ctypes.get_errno())
        if not punch:
            self.cache.grow(h.ino, h.gen, offset + length)

    def _truncate(self, ino: int, fh: int | None, size: int) -> None:
        with self.lock:
            w = self._wopen.get(ino)
            h = self._handles.get(fh) if fh is not None else None
        if w is not None:
            if h is not None and h.writable and h.closed:
                self._written_after_close(h)
            os.ftruncate(w.fd, size)
            return
        fh = self.open(ino, os.O_WRONLY | (os.O_TRUNC if size == 0 else 0))
        try:
            os.ftruncate(self._handles[fh].fd, size)
            self.flush(fh)
        finally:
            self.release(fh)

    # -- close -------------------------------------------------------------------------------
    def close_began(self, fh: int, unique: int) -> None:
        """The engine read a FLUSH of ``fh`` (on its reader thread: never blocks).  If it is
        the last close of a write session here, the head hears now that it began (Began,
        acache.cluster.head.CallEdge), milliseconds before the close itself can reach it."""
        if self.announce is None:
            return
        # no lock (the workers hold it, the reader must not wait): single dict and set reads
        h = self._handles.get(fh)
        w = self._wopen.get(h.ino) if h is not None and h.writable and not h.closed else None
        if w is None or len(w.active) != 1 or fh not in w.active:
            return                       # not the close that journals the file
        token = self.announce()
        with self._began_lock:
            self._began[unique or -fh] = token   # pyfuse3 has no request numbers: by fh
            while len(self._began) > 1024:          # FLUSHes that never ran: forgotten
                self._began.pop(next(iter(self._began)))

    def flush(self, fh: int, unique: int = 0) -> None:
        if self._began:
            with self._began_lock:
                began = self._began.pop(unique or -fh, "")
        else:
            began = ""
        with self.lock:
            h = self._handles.get(fh)
            if h is None or not h.writable:
                return
            w = self._wopen.get(h.ino)
            if h.closed:
                # a FLUSH of a handle already closed once: a close(2) of the last descriptor
                # after a dup's. Served writes reopened it (_written_after_close); the
                # kernel's own (passthrough) did not tell: the cache file says
                again = w is not None and w.direct and not w.active
            else:
                again = False
        if again:
            assert w is not None
            with self._ino_lock(h.ino):
                if not self._rejournal_direct(h, w):
                    s = os.fstat(h.fd)
                    self.ns("close", ino=h.ino, gen=h.gen, size=s.st_size, mtime_ns=s.st_mtime_ns,
                            ctime_ns=s.st_ctime_ns, again=True)
            return
        with self.lock:
            if h.closed:
                return
            h.closed = True
            if w is None:
                return
            w.active.discard(fh)
            last = not w.active
        if last:
            s = os.fstat(h.fd)
            try:
                self.ns("close", ino=h.ino, gen=h.gen, size=s.st_size, mtime_ns=s.st_mtime_ns,
                        ctime_ns=s.st_ctime_ns, began=began)
                w.sig = (s.st_size, s.st_mtime_ns)
            except BaseException:
                # not journaled at the head: the handle stays open, so the next FLUSH (the
                # owner's close(2) after a forked child's exec sent this one) and RELEASE try
                # again -- else a close that failed here would make the next one a no-op that
                # returns 0 for bytes never journaled
                with self.lock:
                    if self._handles.get(fh) is h:
                        h.closed = False
                        if self._wopen.get(h.ino) is w:
                            w.active.add(fh)
                raise
            self.cache.note(h.ino, h.gen, dirty=True, size=s.st_blocks * 512)

    def fsync(self, fh: int, datasync: bool) -> None:
        h = self._handle(fh)
        if h.live:
            return                      # nothing of it here
        (os.fdatasync if datasync else os.fsync)(h.fd)
        self.cache.sync_dir()
        if h.writable:
            s = os.fstat(h.fd)
            self.ns("fsync", ino=h.ino, gen=h.gen, size=s.st_size, mtime_ns=s.st_mtime_ns)

    def release(self, fh: int) -> None:
        w: _Writing | None = None
        with self.lock:
            h = self._handles.pop(fh, None)
            if h is None:
                return
            ended = again = False
            if h.writable:
                w = self._wopen.get(h.ino)
                if w is not None:
                    w.handles.discard(fh)
                    w.active.discard(fh)
                    if not w.handles:
                        del self._wopen[h.ino]
                        ended = True
        try:
            if h.writable and not h.closed:
                self.flush_handle_on_release(h)
            elif ended and w is not None and w.direct:
                again = not self._rejournal_direct(h, w)
            if ended:
                with self._ino_lock(h.ino):
                    with self.lock:
                        reopened = h.ino in self._wopen
                    if not reopened:     # else a new open took the session over meanwhile
                        if again:        # the head checks whether that is needed, in the
                            self.ns("end_write", ino=h.ino, gen=h.gen, again=True)  # same batch
                        else:
                            self.ns("end_write", ino=h.ino, gen=h.gen)
            elif not h.writable:
                self.ns("end_read", ino=h.ino, gen=h.gen)
        finally:
            if not h.live:
                self.cache.release(h.ino, h.gen, write=h.writable)
                self._maybe_drop(h.ino, h.gen)

    def _rejournal_direct(self, h: _Handle, w: _Writing) -> bool:
        """After the session's last close, the kernel wrote the cache file itself: writes
        through a descriptor still open after the last FLUSH (a dup, a forked child, a
        mapping) never reached this daemon, so the cache file is compared with what the last
        close sent; changed, it is journaled again (a close).  False if (size, mtime)
        are unchanged: stores through a mapping into pages already dirty move neither, so the
        caller asks the head to journal it again should that close's PUT have started
        (``again``: it has read bytes that may be old)."""
        s = os.fstat(h.fd)
        if (s.st_size, s.st_mtime_ns) == w.sig:
            return False
        # a close, not reopen + close: the PUT the last close journaled keeps its place even if
        # started (what was journaled after that close returned must not land before it), as
        # on one host (FileOps.release); the new PUT comes after it
        self.ns("close", ino=h.ino, gen=h.gen, size=s.st_size, mtime_ns=s.st_mtime_ns,
                ctime_ns=s.st_ctime_ns)
        w.sig = (s.st_size, s.st_mtime_ns)
        self.cache.note(h.ino, h.gen, dirty=True, size=s.st_blocks * 512)
        return True

    def flush_handle_on_release(self, h: _Handle) -> None:
        """A RELEASE without a FLUSH (the kernel sends FLUSH per close(2); a handle the
        kernel dropped otherwise): close it now, so its bytes are journaled."""
        s = os.fstat(h.fd)
        self.ns("close", ino=h.ino, gen=h.gen, size=s.st_size, mtime_ns=s.st_mtime_ns,
                ctime_ns=s.st_ctime_ns)

    # -- the cache directory, for the head and peers ------------------------------------------
    def _maybe_drop(self, ino: int, gen: int) -> None:
        with self.lock:
            if (ino, gen) in self._drop_later and not self.cache.is_open(ino, gen):
                self._drop_later.discard((ino, gen))
                self._complete.discard((ino, gen))
                self.fetch.forget(ino, gen)
                self.cache.remove(ino, gen)

    def drop(self, ino: int, gen: int) -> None:
        """The head no longer needs (ino, gen): remove it once nobody here has it open."""
        with self.lock:
            self._drop_later.add((ino, gen))
        self._maybe_drop(ino, gen)

    def clean(self, ino: int, gen: int) -> None:
        """(ino, gen) is persisted: evictable."""
        if self.cache.exists(ino, gen) and not self.cache.is_open(ino, gen):
            self.cache.note(ino, gen, dirty=False)

    def evict_cached(self, ino: int, gen: int) -> bool:
        if self.cache.is_open(ino, gen):
            return False
        try:
            ok = self.ns("evict", ino=ino, gen=gen)["ok"]
        except Exception as e:       # the head is unreachable: keep it
            log.debug("evicting inode %d: %s", ino, e)
            return False
        if ok:
            with self.lock:
                self._complete.discard((ino, gen))
            self.fetch.forget(ino, gen)
            self.cache.remove(ino, gen)
        return ok

    def local_files(self) -> dict[int, tuple[int, int]]:
        """ino -> (newest gen, its size) of the cache files here (for rejoining the head)."""
        out: dict[int, tuple[int, int]] = {}
        for ino, gen in self.cache.known():
            if ino not in out or gen > out[ino][0]:
                try:
                    out[ino] = (gen, os.stat(self.cache.path(ino, gen)).st_size)
                except FileNotFoundError:
                    pass
        return out

    def recover(self) -> dict:
        """After a restart: every cache file here is accounted; dirty until the head says
        otherwise (``clean``)."""
        n = 0
        for ino, gen in self.cache.known():
            self.cache.note(ino, gen, dirty=True)
            n += 1
        return {"cache_files": n}
