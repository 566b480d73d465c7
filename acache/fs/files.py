"""Open files: handles, read/write, and close (FLUSH) — the event that orders
and schedules persistence (DESIGN.md points 2 and 3).

A generation's cache file is immutable once a PUT refers to it: opening such a
file for writing gives it a new generation (empty for O_TRUNC, else a copy —
a reflink where the filesystem can), so a pending upload never sees later
writes.  Readers keep the generation they opened.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import time
from dataclasses import dataclass

from acache.errors import AcacheError, FsError, NewFile
from acache.data.readthrough import ReadThrough
from acache.fs.namespace import Namespace
from acache.fs.types import Attr
from acache.meta import journal
from acache.meta.store import Inode

log = logging.getLogger("acache.vfs")

FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE = 0x01, 0x02, 0x10
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def check_fallocate(mode: int, offset: int, length: int) -> bool:
    """The fallocate(2) modes a cache file serves (EOPNOTSUPP for others, EINVAL for a bad
    range); returns whether it punches a hole."""
    known = FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE
    punch = bool(mode & FALLOC_FL_PUNCH_HOLE)
    if mode & ~known or (punch and (mode & FALLOC_FL_ZERO_RANGE or not mode & FALLOC_FL_KEEP_SIZE)):
        raise FsError(errno.EOPNOTSUPP)
    if offset < 0 or length <= 0:
        raise FsError(errno.EINVAL)
    return punch


@dataclass
class Handle:
    fh: int
    ino: int
    gen: int
    fd: int
    writable: bool
    closed: bool = False          # FLUSH seen (close(2) of one of its fds)


class FileOps(Namespace):
    """The open files of one host, over its namespace (VFS puts them together)."""
    fetch: ReadThrough          # the under-storage's bytes of files not cached (VFS makes it)

    def _init_files(self) -> None:
        self._handles: dict[int, Handle] = {}
        self._fh_next = 0
        self._opens: dict[int, int] = {}             # ino -> open handles
        # ino -> write opens between filling a read-through file whole and their handle:
        # not evicted meanwhile (else the open would find it uncached and start it empty)
        self._pins: dict[int, int] = {}
        self._writers: dict[int, set[int]] = {}      # ino -> write handles not yet closed
        self._wopen: dict[int, int] = {}             # ino -> write handles not yet released
        self._wgen: dict[tuple[int, int], set[int]] = {}   # (ino, gen) -> those write handles
        self._sig: dict[int, tuple[int, int]] = {}   # ino -> (size, mtime) when last journaled
        self._put_seq: dict[int, int] = {}           # ino -> the PUT its last close journaled
        self._direct: set[int] = set()               # inos the kernel may write without us

    def _open_count(self, ino: int) -> int:
        return self._opens.get(ino, 0)

    def handle_ino(self, fh: int) -> int | None:
        h = self._handles.get(fh)
        return h.ino if h is not None else None

    def is_open(self, ino: int) -> bool:
        return bool(self._opens.get(ino))

    def _write_fd(self, node: Inode) -> int | None:
        if self._wopen.get(node.ino):
            return self.cache.fd_of(node.ino, node.gen)
        return None

    def _handle(self, fh: int) -> Handle:
        h = self._handles.get(fh)
        if h is None:
            raise FsError(errno.EBADF)
        return h

    def _new_handle(self, node: Inode, writable: bool, fd: int | None = None) -> int:
        """A handle of ``node``; ``fd``: its generation's shared fd, already acquired
        for this handle (a create's)."""
        if fd is None:
            fd = self.cache.acquire(node.ino, node.gen, create=True, write=writable)
        self._fh_next += 1
        h = Handle(self._fh_next, node.ino, node.gen, fd, writable)
        self._handles[h.fh] = h
        self._opens[node.ino] = self._opens.get(node.ino, 0) + 1
        if writable:
            self._writers.setdefault(node.ino, set()).add(h.fh)
            self._wopen[node.ino] = self._wopen.get(node.ino, 0) + 1
            self._wgen.setdefault((node.ino, node.gen), set()).add(h.fh)
        return h.fh

    def _upath_fn(self, ino: int):
        def upath() -> str:
            node = self.meta.get(ino)
            return node.upath if node is not None and node.upath is not None else ""
        return upath

    # -- open / create ------------------------------------------------------------------
    def create(self, parent: int, name: bytes, mode: int, flags: int, ctx) -> tuple[int, Attr]:
        self._check_name(name)
        existing = self._child(parent, name)
        if existing is not None:
            if flags & os.O_EXCL:
                raise FsError(errno.EEXIST)
            if existing.is_dir:
                raise FsError(errno.EISDIR)
            fh = self.open(existing.ino, flags, ctx)
            with self.lock:
                return fh, self.attr(existing)
        self.cache.wait_for_room()
        with self.lock:
            p = self._dir(parent)
            if self.meta.child(parent, name) is not None:
                raise FsError(errno.EEXIST)
            txn = self.meta.txn()
            now = time.time_ns()
            gid, mode = self._group_of_new(p, ctx, mode & 0o7777)
            node = self.meta.new_inode(txn, mode=0o100000 | mode, uid=ctx.uid, gid=gid,
                                       atime_ns=now, mtime_ns=now, ctime_ns=now, parent=parent,
                                       name=name, dirty=True, cached=True)
            # the cache file is created by the open its handle keeps (one open, not two)
            fd = self.cache.acquire(node.ino, 0, write=True, empty=True)
            txn.link(parent, name, node.ino)
            self._touch_dir(txn, p)
            try:
                txn.commit()
            except BaseException as e:
                self.cache.release(node.ino, 0, write=True)
                if isinstance(e, AcacheError):     # the failed create leaves nothing behind
                    self.cache.remove(node.ino, 0)
                raise
            self.cache.note(node.ino, 0, dirty=True, size=0)
            fh = self._new_handle(node, True, fd)
            return fh, self.attr(node)

    def open(self, ino: int, flags: int, ctx=None, same_file: bool = False) -> int:
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        trunc = writable and bool(flags & os.O_TRUNC)
        node = self._node(ino)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        pinned = False
        try:
            if writable:
                self.cache.wait_for_room()
                if not node.cached and not trunc and node.size:
                    with self.lock:
                        self._pins[ino] = self._pins.get(ino, 0) + 1
                    pinned = True
                    self._fill_whole(node)
            return self._open_locked(ino, writable, trunc, same_file)
        finally:
            if pinned:
                with self.lock:
                    self._pins[ino] -= 1
                    if not self._pins[ino]:
                        del self._pins[ino]

    def _open_locked(self, ino: int, writable: bool, trunc: bool, same_file: bool) -> int:
        with self.lock:
            node = self._node(ino)
            if not writable:
                self.cache.touch(ino)
                return self._new_handle(node, False)
            if not node.cached and not trunc and node.size:
                # never start a non-empty file over empty: whatever it was, it is an error
                log.error("open of inode %d for writing: its data is not in the cache", ino)
                raise FsError(errno.EIO)
            old_gen = node.gen
            txn = self.meta.txn()
            if self._gen_writers(ino, node.gen):
                # others write this generation still (their FLUSH came without a RELEASE:
                # a fork, a dup'd fd): one generation for all writers, never two
                journal.on_reopen(self.meta, txn, self.persister, node)
                self._sig.pop(ino, None)   # its next close journals it, changed or not
            elif self._newest_unstarted(ino, node.gen):
                # its pending PUT is the journal's newest entry and has not started:
                # nothing can overtake it, so write in place and journal it again at close
                # (no copy of the whole file, e.g. fio's create-close-reopen)
                journal.on_reopen(self.meta, txn, self.persister, node)
                self._sig.pop(ino, None)
            elif node.cached and not trunc and not self.cache.cheap_clone(node.size) \
                    and self.meta.gen_pending(ino, node.gen) \
                    and journal.hold_put(self.meta, txn, self.persister, node):
                # a big file, no reflink: rather than copy it, write in place; its PUT
                # keeps its place and waits for this writer's close
                self._sig.pop(ino, None)
            elif self.meta.gen_pending(ino, node.gen) or self.persister.uses(ino, node.gen) \
                    or not node.cached:
                if same_file:
                    raise NewFile()
                node.gen += 1
                if trunc or not node.cached:
                    self.cache.create_empty(ino, node.gen)
                else:
                    self.cache.clone(ino, old_gen, node.gen)
                node.cached = True
            # its next close journals it, whatever (size, mtime) then says: a same-size
            # overwrite within the cache filesystem's timestamp granularity, or one whose
            # mtime is set back (cp -p, rsync -t), keeps the signature of the last close
            self._sig.pop(ino, None)
            if trunc:
                node.size = 0
                node.synced = min(node.synced, 0)   # what an fsync covered is gone
                node.mtime_ns = node.ctime_ns = time.time_ns()
            node.dirty = True
            txn.save(node)
            new_gen = node.gen
            try:
                txn.commit()
            except AcacheError:      # undone: node.gen is old_gen again
                if new_gen != old_gen:
                    self.cache.remove(ino, new_gen)
                raise
            if trunc and new_gen == old_gen:   # in place, once the open is recorded
                os.truncate(self.cache.path(ino, node.gen), 0)
            self.cache.note(ino, node.gen, dirty=True)
            fh = self._new_handle(node, True)
            if old_gen != node.gen:
                self.gc_gen(ino, old_gen)
            return fh

    def _fill_whole(self, node: Inode) -> None:
        """Fetch a read-through file completely (before it is opened for writing)."""
        with self.lock:
            fd = self.cache.acquire(node.ino, node.gen, create=True)
            gen = node.gen
        try:
            self.fetch.fetch_all(node.ino, gen, fd, self._upath_fn(node.ino), node.size)
            with self.lock:
                if node.gen == gen and not node.cached:
                    node.cached = True
                    txn = self.meta.txn()
                    txn.save(node)
                    txn.commit()
        finally:
            self.cache.release(node.ino, gen)

    def _local_fd(self, h: Handle) -> int | None:
        """The handle's cache fd if its data is complete in the cache, else None."""
        node = self.meta.get(h.ino)
        if node is None or (h.gen == node.gen and not node.cached):
            return None
        return h.fd

    def backing_fd(self, fh: int) -> int | None:
        """The cache file ``fh`` reads and writes, passed through or not: the engine must
        never pass an open through to another file (an older generation's)."""
        with self.lock:
            h = self._handles.get(fh)
            return h.fd if h is not None else None

    def passthrough_fd(self, fh: int, opening: bool = False) -> int | None:
        """The cache fd the kernel may read and write directly for ``fh``, or None.
        ``opening``: asked for a new open (a write open gets none near the cache limit)."""
        with self.lock:
            h = self._handle(fh)
            if opening and h.writable and not self.cache.roomy():
                return None    # near the limit: served by the daemon, whose writes wait for room
            fd = self._local_fd(h)
            if fd is not None and h.writable:
                self._direct.add(h.ino)
            return fd

    # -- data ------------------------------------------------------------------------------
    def read(self, fh: int, offset: int, size: int) -> bytes:
        h = self._handle(fh)
        node = self.meta.get(h.ino)
        if node is not None and h.gen == node.gen and not node.cached:
            size = max(0, min(size, node.size - offset))
            if size == 0:
                return b""
            # served from the fetched chunk (its copy written behind), fetching ahead
            data, whole = self.fetch.read(h.ino, h.gen, h.fd, self._upath_fn(h.ino), node.size,
                                          offset, size)
            if whole:
                with self.lock:
                    if node.gen == h.gen and not node.cached:
                        node.cached = True
                        txn = self.meta.txn()
                        txn.save(node)
                        try:
                            txn.commit()
                            self.cache.note(h.ino, h.gen, dirty=False)
                        except AcacheError:   # undone (logged): read through again later
                            pass
            return data
        return os.pread(h.fd, size, offset)

    def read_fast(self, fh: int, offset: int, size: int) -> bytes | None:
        """read() for an engine's event loop: a pread of data complete in the cache;
        None when the caller must use read() (from a worker thread) instead."""
        h = self._handles.get(fh)
        fd = self._local_fd(h) if h is not None else None
        return os.pread(fd, size, offset) if fd is not None else None

    def write(self, fh: int, offset: int, data) -> int:
        h = self._handle(fh)
        if not h.writable:
            raise FsError(errno.EBADF)
        if h.closed:   # written again through a dup'd descriptor after a close
            self._written_after_close(h)
        n = os.pwrite(h.fd, data, offset)
        self.cache.grow(h.ino, h.gen, offset + n)
        return n

    def write_fast(self, fh: int, offset: int, data) -> int | None:
        """write() for an engine's event loop: never waits for cache room or the lock;
        None when the caller must use write() (from a worker thread) instead."""
        h = self._handles.get(fh)
        if h is None or not h.writable or h.closed or not self.cache.has_room(len(data)):
            return None
        n = os.pwrite(h.fd, data, offset)
        self.cache.account(h.ino, h.gen, offset + n)
        return n

    def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        """fallocate(2) through an open write handle, done on its cache file like a write
        (the file is journaled at its close if its bytes or size changed): allocation,
        with or without FALLOC_FL_KEEP_SIZE; PUNCH_HOLE|KEEP_SIZE; ZERO_RANGE.  Other
        modes: EOPNOTSUPP (a program then writes the zeros itself); a mode the cache
        filesystem lacks: its errno."""
        punch = check_fallocate(mode, offset, length)
        h = self._handle(fh)
        if not h.writable:
            raise FsError(errno.EBADF)
        if h.closed:   # through a dup'd descriptor after a close
            self._written_after_close(h)
        if _libc.fallocate(h.fd, mode, offset, length) != 0:
            raise FsError(ctypes.get_errno())
        if mode != FALLOC_FL_KEEP_SIZE:
            # bytes or size may have changed within the cache filesystem's timestamp
            # granularity: its close journals it whatever (size, mtime) then says
            with self.lock:
                self._sig.pop(h.ino, None)
        if not punch:  # the blocks are the cache's now, like written bytes
            self.cache.grow(h.ino, h.gen, offset + length)

    def _gen_writers(self, ino: int, gen: int) -> bool:
        return bool(self._wgen.get((ino, gen)))

    def withdraw_put(self, e) -> bool:
        """Asked (under the lock) before a staged PUT commits.  A FLUSH journaled it while
        the generation stayed open for writing (a fork's copy of the descriptor was
        closed, a dup): if the bytes changed since -- passthrough writes never reach
        write() -- they are not what that close saw, and what was staged may be torn.
        Withdraw it; the writer's own close (or the RELEASE) journals the file again."""
        node = self.meta.get(e.ino)
        fd = self.cache.fd_of(e.ino, e.gen)
        if node is None or node.gen != e.gen or fd is None or not self._gen_writers(e.ino, e.gen):
            return False
        s = os.fstat(fd)
        if (s.st_size, s.st_mtime_ns) == self._sig.get(e.ino):
            return False
        for h in [self._handles[fh] for fh in sorted(self._wgen.get((e.ino, e.gen), ()))
                  if self._handles[fh].closed]:
            self._written_after_close(h)
        return self.meta.entry(e.seq) is None

    def _written_after_close(self, h: Handle) -> None:
        """A FLUSH (close(2) of one descriptor: a dup, the copy a fork+exec closed) made
        the file look closed, yet its owner writes on: it is open for writing again, and
        what that close journaled is not its content (before the bytes change)."""
        with self.lock:
            if not h.closed:
                return
            h.closed = False
            self._writers.setdefault(h.ino, set()).add(h.fh)
            node = self.meta.get(h.ino)
            if node is not None and node.gen == h.gen:
                txn = self.meta.txn()
                journal.on_reopen(self.meta, txn, self.persister, node)
                self._sig.pop(h.ino, None)   # its next close journals it, changed or not
                node.dirty = True
                txn.save(node)
                txn.commit()

    # -- close ------------------------------------------------------------------------------
    def flush(self, fh: int, unique: int = 0) -> None:
        with self.meta.op(), self.lock:
            h = self._handles.get(fh)
            if h is None or not h.writable or h.closed:
                return
            h.closed = True
            active = self._writers.get(h.ino, set())
            active.discard(fh)
            if not active:
                try:
                    self._close_file(h)
                except BaseException:
                    # not journaled: the handle stays open for the next FLUSH (a forked
                    # child's exec sends one before the owner's close(2), which must then
                    # journal, or fail, itself) and for RELEASE
                    h.closed = False
                    self._writers.setdefault(h.ino, set()).add(fh)
                    raise

    def _close_file(self, h: Handle) -> None:
        """The last writer closed the file: journal its commit (under the lock)."""
        node = self.meta.get(h.ino)
        if node is None or h.gen != node.gen:
            return
        s = os.fstat(h.fd)
        sig = (s.st_size, s.st_mtime_ns)
        txn = self.meta.txn()
        node.size = s.st_size
        if sig != self._sig.get(h.ino):      # unchanged since its last journaled close: no upload
            node.mtime_ns = max(node.mtime_ns, s.st_mtime_ns)
            node.ctime_ns = max(node.ctime_ns, s.st_ctime_ns)
            if node.nlink > 0:
                self._put_seq[h.ino] = journal.journal_put(self.meta, txn, self.persister, node).seq
        node.dirty = False
        node.synced = -1                     # the close acknowledges it whole
        node.local = ""
        txn.save(node)
        txn.commit()
        self._sig[h.ino] = sig     # only now: a close that failed to journal must not look done
        self.cache.note(h.ino, h.gen, dirty=True, size=s.st_blocks * 512)
        self.persister.wake()

    def release(self, fh: int) -> None:
        reap = None
        with self.lock:
            h = self._handles.pop(fh, None)
            if h is None:
                return
            self._opens[h.ino] -= 1
            if not self._opens[h.ino]:
                del self._opens[h.ino]
            node = self.meta.get(h.ino)
            if h.writable:
                self._writers.get(h.ino, set()).discard(fh)
                wgen = self._wgen.get((h.ino, h.gen), set())
                wgen.discard(fh)
                if not wgen:
                    self._wgen.pop((h.ino, h.gen), None)
                self._wopen[h.ino] -= 1
                if not self._wopen[h.ino]:
                    del self._wopen[h.ino]
                    self._writers.pop(h.ino, None)
                    direct = h.ino in self._direct
                    self._direct.discard(h.ino)
                    if node is not None and node.gen == h.gen:
                        s = os.fstat(h.fd)
                        if direct and not self._put_unstarted(h.ino):
                            # the kernel wrote its cache file directly (passthrough) and what
                            # its close journaled has started or landed: stores through a
                            # mapping after the close leave mtime alone on pages already
                            # dirty, so the signature cannot tell; journal it again
                            self._sig.pop(h.ino, None)
                        if node.dirty or (s.st_size, s.st_mtime_ns) != self._sig.get(h.ino):
                            try:   # written after its close (mmap, dup'd fd)
                                self._close_file(h)
                            except AcacheError:   # metadata write failed: the file stays
                                pass              # dirty; journal_unjournaled() retries
            self.cache.release(h.ino, h.gen, write=h.writable)
            if node is not None and node.nlink == 0 and h.ino not in self._opens:
                reap = node
            elif node is None or h.gen != node.gen:
                self.gc_gen(h.ino, h.gen)
        if reap is not None:
            self._sig.pop(reap.ino, None)
            self._put_seq.pop(reap.ino, None)
            self._reap(reap)

    def _put_unstarted(self, ino: int) -> bool:
        """Is the PUT the file's last close journaled still pending, not started (so it
        will read what the cache file holds by then)?"""
        seq = self._put_seq.get(ino)
        return seq is not None and self.meta.entry(seq) is not None and self.persister.state(seq) == ""

    def journal_unjournaled(self) -> list[int]:
        """Files whose last close could not be journaled (a metadata write failed) are
        dirty with no writer: journal them now.  Returns their inos; raises MetaError while
        the metadata store still fails.  O(inodes): for barriers, not per operation."""
        done = []
        with self.lock:
            for node in self.meta.inodes():
                if not node.dirty or node.is_dir or node.nlink == 0 or self._wopen.get(node.ino):
                    continue
                try:
                    fd = self.cache.acquire(node.ino, node.gen)
                except FileNotFoundError:
                    continue
                try:
                    self._close_file(Handle(0, node.ino, node.gen, fd, True))
                finally:
                    self.cache.release(node.ino, node.gen)
                done.append(node.ino)
        if done:
            self.persister.wake()
        return done

    def fsync(self, fh: int, datasync: bool) -> None:
        h = self._handle(fh)
        (os.fdatasync if datasync else os.fsync)(h.fd)
        self.cache.sync_dir()
        with self.lock:
            node = self.meta.get(h.ino)
            if node is None:
                return
            if h.writable and node.gen == h.gen:
                s = os.fstat(h.fd)
                node.size = s.st_size
                node.mtime_ns = max(node.mtime_ns, s.st_mtime_ns)
                node.ctime_ns = max(node.ctime_ns, s.st_ctime_ns)
                node.synced = s.st_size   # acknowledged: recovery publishes at least this
            txn = self.meta.txn()
            txn.save(node)
            txn.commit(sync=True)

    def _truncated(self, ino: int, gen: int, size: int) -> None:
        """A file open for writing was cut to ``size``: an fsync before acknowledged at
        most that much now (recovery must not take the cut for a short cache file)."""
        with self.lock:
            node = self.meta.get(ino)
            if node is not None and node.gen == gen and size < node.synced:
                node.synced = size
                txn = self.meta.txn()
                txn.save(node)
                txn.commit()

    def _truncate(self, ino: int, fh: int | None, size: int) -> None:
        """truncate(2)/ftruncate(2): through an open write handle, or as open+close."""
        if fh is not None and fh in self._handles and self._handles[fh].writable:
            h = self._handles[fh]
            if h.closed:
                self._written_after_close(h)
            os.ftruncate(h.fd, size)
            self._truncated(h.ino, h.gen, size)
            return
        with self.lock:
            node = self._node(ino)
            if node.is_dir:
                raise FsError(errno.EISDIR)
            fd = self.cache.fd_of(ino, node.gen)
            if self._wopen.get(ino) and fd is not None:
                os.ftruncate(fd, size)
                self._truncated(ino, node.gen, size)
                return
        fh = self.open(ino, os.O_WRONLY | (os.O_TRUNC if size == 0 else 0))
        try:
            os.ftruncate(self._handles[fh].fd, size)
            self.flush(fh)
        finally:
            self.release(fh)
