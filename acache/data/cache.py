"""Cache files on the local disk: one file per (inode, data generation).

    <cache_dir>/data/<ino:x>.<gen>

A generation's file is the backing file of the mount (pwrite, or the kernel
itself with passthrough).  Space: clean files (their content is persisted) are
evicted LRU; dirty ones never.  Writers wait for space (backpressure) instead of
failing; ENOSPC only after ``stall_timeout``.

The limit in force is ``effective_limit()``: ``limit``, lowered so that the filesystem
keeps the metadata reserve free (acache.meta.reserve).  Writes the daemon serves are
accounted as they happen; writes the kernel passes through to a cache file are not seen
at all, so a monitor thread fstat's the files open for writing every ``MONITOR_EVERY`` s
(while there are any), accounts their growth and evicts clean data to make up for it.
New write opens wait for room like writes do, and near the limit (``roomy()`` is False)
they are served by the daemon instead of passed through, so their writes wait too.
What stays soft: a file opened with passthrough while there was room writes past the
limit until its close, at most until the filesystem's free space is gone (the ballast
keeps the metadata's room).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from typing import Callable, Protocol
from collections import OrderedDict

from acache.errors import FsError

log = logging.getLogger("acache.cache")
FICLONE = 0x40049409



class Evictor(Protocol):
    """The layer that knows whether a clean cache file may go (one host's VFS, a cluster
    node's ClientVFS: its head is asked), handed once with :meth:`CacheDir.attach`."""

    def evict_cached(self, ino: int, gen: int) -> bool:
        """Remove (ino, gen)'s cache file if it is still clean and unneeded; whether it did."""

class _Sizes(dict):
    """(ino, gen) -> bytes, with a running total (asked on every write)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __setitem__(self, key, value) -> None:
        self.total += value - self.get(key, 0)
        super().__setitem__(key, value)

    def pop(self, key, default=None):
        value = super().pop(key, None)
        if value is None:
            return default
        self.total -= value
        return value


class CacheDir:
    MONITOR_EVERY = 0.1      # s between fstat's of the files open for writing
    ROOMY = 8                # write opens are passed through while > limit/ROOMY is free

    def __init__(self, root: str, limit: int, stall_timeout: float, reserve=None) -> None:
        self.root = root
        self.dir = os.path.join(root, "data")
        os.makedirs(self.dir, exist_ok=True)
        self.limit = limit
        self.stall_timeout = stall_timeout
        self._fds: dict[tuple[int, int], list[int]] = {}   # (ino, gen) -> [fd, refs]
        self._lock = threading.Lock()
        self._dir_lock = threading.Lock()   # one directory fsync at a time (sync_dir)
        self.space = threading.Condition(self._lock)        # room was made: waiting writers
        self._writers = threading.Condition(self._lock)     # a write open: the monitor starts
        self._sizes = _Sizes()                             # bytes on disk per file we know
        self.dirty: set[tuple[int, int]] = set()           # files that may not be evicted
        self.lru: OrderedDict[int, int] = OrderedDict()    # clean ino -> gen, oldest first
        self.evictor: Evictor | None = None                # removes (ino, gen) if still clean
        self.on_stall: Callable[[], None] | None = None    # writers wait: persist now
        self.stalls = 0                                    # writers that waited for room
        self.stall_seconds = 0.0                           # ... how long, all together
        self.enospc = 0                                    # ... and gave up (stall_timeout)
        self.evictions = 0                                 # clean files evicted
        self.evicted_bytes = 0
        self._reflink: bool | None = None
        self.reserve = reserve                              # acache.meta.reserve.Reserve | None
        self._writing: dict[tuple[int, int], int] = {}      # (ino, gen) -> write opens
        self._fs_base = 0                                   # used + the filesystem's free bytes
        self._fs_next = 0.0                                 # when to statvfs again
        self._over = False                                  # logged: over the limit
        self._monitor: threading.Thread | None = None

    def path(self, ino: int, gen: int) -> str:
        return os.path.join(self.dir, f"{ino:x}.{gen}")

    # -- file descriptors shared by every open of one generation --------------------
    def acquire(self, ino: int, gen: int, create: bool = False, write: bool = False,
                empty: bool = False) -> int:
        """The shared fd of a generation; ``write``: for a write open (its growth is
        monitored until the matching ``release(write=True)``); ``empty``: a new generation,
        created empty (what ``create_empty`` does, in the same open)."""
        key = (ino, gen)
        with self._lock:
            if key in self._fds:
                self._fds[key][1] += 1
                fd = self._fds[key][0]
                if empty:
                    os.ftruncate(fd, 0)
            else:
                flags = os.O_RDWR | os.O_CLOEXEC
                if create or empty:
                    flags |= os.O_CREAT
                if empty:
                    flags |= os.O_TRUNC
                fd = os.open(self.path(ino, gen), flags, 0o600)
                self._fds[key] = [fd, 1]
                self.lru.pop(ino, None)
            if write:
                if not self._writing:
                    self._writers.notify()    # the monitor starts watching
                self._writing[key] = self._writing.get(key, 0) + 1
            return fd

    def release(self, ino: int, gen: int, write: bool = False) -> None:
        key = (ino, gen)
        with self._lock:
            ent = self._fds.get(key)
            if ent is None:
                return
            if write and key in self._writing:
                self._writing[key] -= 1
                if not self._writing[key]:
                    del self._writing[key]
            ent[1] -= 1
            if ent[1] == 0:
                os.close(ent[0])
                del self._fds[key]
                if key in self._sizes and key not in self.dirty and self.lru.get(ino, -1) <= gen:
                    self.lru[ino] = gen          # clean and closed: evictable again, newest
                    self.lru.move_to_end(ino)
                    self.space.notify_all()

    def attach(self, evictor: Evictor) -> None:
        """Who decides an eviction (built after the cache: it needs it)."""
        if self.evictor is not None:
            raise RuntimeError("the cache directory has an evictor already")
        self.evictor = evictor

    def is_open(self, ino: int, gen: int) -> bool:
        return (ino, gen) in self._fds

    def fd_of(self, ino: int, gen: int) -> int | None:
        ent = self._fds.get((ino, gen))
        return ent[0] if ent else None

    # -- generations ----------------------------------------------------------------
    def create_empty(self, ino: int, gen: int) -> None:
        fd = os.open(self.path(ino, gen), os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.close(fd)

    def clone(self, ino: int, src_gen: int, dst_gen: int) -> None:
        """Copy a generation (reflink where the filesystem can, else copy_file_range)."""
        src = os.open(self.path(ino, src_gen), os.O_RDONLY | os.O_CLOEXEC)
        dst = os.open(self.path(ino, dst_gen), os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.ioctl(dst, FICLONE, src)
            except OSError:
                size = os.fstat(src).st_size
                off = 0
                while off < size:
                    n = os.copy_file_range(src, dst, size - off, off, off)
                    if n == 0:
                        break
                    off += n
        finally:
            os.close(src)
            os.close(dst)

    CLONE_MAX = 64 << 20      # copy a generation up to this size when reflinks are missing

    def cheap_clone(self, size: int) -> bool:
        """Is cloning a generation of ``size`` bytes cheap here (reflink, or small)?"""
        if self._reflink is None:
            a = os.path.join(self.dir, ".reflink-probe-a")
            b = os.path.join(self.dir, ".reflink-probe-b")
            try:
                with open(a, "wb") as fa, open(b, "wb") as fb:
                    fa.write(b"x")
                    fa.flush()
                    fcntl.ioctl(fb.fileno(), FICLONE, fa.fileno())
                self._reflink = True
            except OSError:
                self._reflink = False
            finally:
                for p in (a, b):
                    try:
                        os.unlink(p)
                    except FileNotFoundError:
                        pass
        return self._reflink or size <= self.CLONE_MAX

    def remove(self, ino: int, gen: int) -> None:
        with self._lock:
            self._sizes.pop((ino, gen), None)
            self.dirty.discard((ino, gen))
            if self.lru.get(ino) == gen:
                del self.lru[ino]
            self.space.notify_all()
        try:
            os.unlink(self.path(ino, gen))
        except FileNotFoundError:
            pass

    def exists(self, ino: int, gen: int) -> bool:
        return os.path.exists(self.path(ino, gen))

    def disk_size(self, ino: int, gen: int) -> int:
        try:
            return os.stat(self.path(ino, gen)).st_blocks * 512
        except FileNotFoundError:
            return 0

    # -- accounting -------------------------------------------------------------------
    def note(self, ino: int, gen: int, dirty: bool, size: int | None = None) -> None:
        """Record a file's size on disk and whether it may be evicted."""
        key = (ino, gen)
        with self._lock:
            self._sizes[key] = self.disk_size(ino, gen) if size is None else size
            if dirty:
                self.dirty.add(key)
                self.lru.pop(ino, None)
            else:
                self.dirty.discard(key)
                if key not in self._fds:
                    self.lru[ino] = gen
                    self.lru.move_to_end(ino)
            self.space.notify_all()
        if not dirty and self.used() > self.effective_limit():
            self.make_room(0)   # clean again and over the limit (passthrough writes are not
                                # seen until close): evict now, not at the next open

    def touch(self, ino: int) -> None:
        with self._lock:
            if ino in self.lru:
                self.lru.move_to_end(ino)

    def account(self, ino: int, gen: int, end: int) -> bool:
        """A write reached ``end``: account it; True if the file grew."""
        key = (ino, gen)
        with self._lock:
            if end <= self._sizes.get(key, 0):
                return False
            self._sizes[key] = end
            return True

    def grow(self, ino: int, gen: int, end: int) -> None:
        """A write reached ``end``: account it, and wait for room if over the limit."""
        if self.account(ino, gen, end):
            self.wait_for_room()

    def has_room(self, need: int) -> bool:
        return self._sizes.total + need <= self.effective_limit()

    def effective_limit(self) -> int:
        """``limit``, lowered so that the filesystem keeps the metadata reserve free.
        ``used + free`` does not change with our own writes or evictions, so it is
        sampled (statvfs) at most every 20 ms."""
        now = time.monotonic()
        if now >= self._fs_next:
            st = os.statvfs(self.dir)
            self._fs_base = self._sizes.total + st.f_bavail * st.f_frsize
            self._fs_next = now + 0.02
        keep = self.reserve.keep() if self.reserve is not None else 0
        return max(0, min(self.limit, self._fs_base - keep))

    def roomy(self) -> bool:
        """Is there room enough to pass a new write open through to the kernel (whose
        writes the limit cannot hold back until the file's close)?"""
        limit = self.effective_limit()
        return limit - self.used() > limit // self.ROOMY

    # -- files open for writing: their size as the kernel writes them ---------------------
    def start_monitor(self) -> None:
        self._monitor = threading.Thread(target=self._watch, name="acache-cache-monitor",
                                         daemon=True)
        self._monitor.start()

    def _watch(self) -> None:
        while True:
            with self._lock:
                while not self._writing:
                    self._writers.wait()
                fds = [(key, self._fds[key][0]) for key in self._writing if key in self._fds]
            self.watch_once(fds)
            time.sleep(self.MONITOR_EVERY)

    def watch_once(self, fds=None) -> None:
        """Account the growth of the files open for writing; evict to make up for it."""
        if fds is None:
            with self._lock:
                fds = [(key, self._fds[key][0]) for key in self._writing if key in self._fds]
        grew = False
        for (ino, gen), fd in fds:
            try:
                st = os.fstat(fd)
            except OSError:          # closed meanwhile
                continue
            grew = self.account(ino, gen, st.st_blocks * 512) or grew
        if not grew:
            return
        limit = self.effective_limit()
        if self.used() > limit:
            self.make_room(0)
            if self.used() > limit and not self._over:
                self._over = True
                log.warning("the cache is over its limit (%d of %d bytes): files open with "
                            "passthrough keep writing; new writes wait for room",
                            self.used(), limit)
        elif self._over:
            self._over = False

    def filled(self, ino: int, gen: int, nbytes: int) -> None:
        """Read-through takes ``nbytes`` more room in a clean cache file (counted when its
        fetch begins, before they are written); negative: a chunk that was not written."""
        if not self.exists(ino, gen):   # evicted while the fetch ran
            return
        with self._lock:
            self._sizes[(ino, gen)] = max(0, self._sizes.get((ino, gen), 0) + nbytes)

    def make_room(self, need: int) -> None:
        """Readers: evict clean data so that ``need`` more bytes fit.  Never waits and
        never fails: with only dirty or open data left, the cache goes over its limit
        (writers are held back until it is under again)."""
        while self.used() + need > self.effective_limit():
            if not self._evict_one():
                return

    def used(self) -> int:
        return self._sizes.total

    def dirty_bytes(self) -> int:
        return sum(self._sizes.get(k, 0) for k in list(self.dirty))

    def dirty_stats(self) -> tuple[int, int]:
        """(bytes, files) not yet persisted, counted together (metrics)."""
        with self._lock:
            return sum(self._sizes.get(k, 0) for k in self.dirty), len(self.dirty)

    def wait_for_room(self, need: int = 0) -> None:
        """Backpressure: evict clean data; if dirty data fills the cache, wait."""
        if self.used() + need <= self.effective_limit():
            return                          # the common case: room enough
        started: list[float] = []          # set when this writer starts waiting
        try:
            self._wait_for_room(need, started)
        finally:
            if started:
                waited = time.monotonic() - started[0]
                with self._lock:
                    self.stall_seconds += waited

    def _wait_for_room(self, need: int, started: list[float]) -> None:
        deadline = None
        while self.used() + need > (limit := self.effective_limit()):
            if self._evict_one():
                continue
            if self.dirty_bytes() + need <= limit:
                return   # only dirty + open files: over the soft limit but nothing to wait for
            if deadline is None:
                started.append(time.monotonic())
                deadline = started[0] + self.stall_timeout
                self.stalls += 1
                log.warning("cache full of dirty data (%d of %d bytes): writers wait for persisting",
                            self.dirty_bytes(), limit)
                if self.on_stall is not None:
                    self.on_stall()     # no flush delay while writers wait for room
            left = deadline - time.monotonic()
            if left <= 0:
                log.error("ENOSPC: dirty data stayed above the cache limit (%d bytes) for %.0f s "
                          "(stall_timeout); is the under-storage reachable?", limit, self.stall_timeout)
                self.enospc += 1
                raise FsError(errno.ENOSPC)
            with self._lock:
                self.space.wait(min(left, 0.5))

    def _evict_one(self) -> bool:
        with self._lock:
            if not self.lru:
                return False
            ino, gen = self.lru.popitem(last=False)
            size = self._sizes.get((ino, gen), 0)
        if self.evictor is not None and self.evictor.evict_cached(ino, gen):
            self.evictions += 1
            self.evicted_bytes += size
            return True
        return bool(self.lru)

    def known(self) -> set[tuple[int, int]]:
        out = set()
        for name in os.listdir(self.dir):
            ino, _, gen = name.partition(".")
            try:
                out.add((int(ino, 16), int(gen)))
            except ValueError:
                continue
        return out

    def known_for(self, ino: int) -> list[tuple[int, int]]:
        prefix = f"{ino:x}."
        out = []
        for name in os.listdir(self.dir):
            if name.startswith(prefix) and name[len(prefix):].isdigit():
                out.append((ino, int(name[len(prefix):])))
        return out

    # -- cache files nobody knows ------------------------------------------------------
    @property
    def lost_dir(self) -> str:
        return os.path.join(self.root, "lost+found")

    def set_aside(self, ino: int, gen: int) -> str:
        """Move a cache file the metadata does not know into lost+found (never delete
        it: after lost metadata it may be the only copy of a closed file)."""
        os.makedirs(self.lost_dir, mode=0o700, exist_ok=True)
        base = dst = os.path.join(self.lost_dir, f"{ino:x}.{gen}")
        n = 0
        while os.path.lexists(dst):
            n += 1
            dst = f"{base}~{n}"
        os.rename(self.path(ino, gen), dst)
        return dst

    def lost_found(self) -> tuple[int, int]:
        """(files, bytes) in lost+found."""
        files = size = 0
        try:
            with os.scandir(self.lost_dir) as it:
                for ent in it:
                    if ent.is_file(follow_symlinks=False):
                        files += 1
                        size += ent.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            pass
        return files, size

    def sync_dir(self) -> None:
        """fsync the directory of the cache files (a new file's name is durable after it)."""
        with self._dir_lock:
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def statvfs(self) -> os.statvfs_result:
        return os.statvfs(self.dir)
