"""Read-through: fill a cache file from the under-storage (or a peer) in large chunks.

A file that is not (wholly) in the cache is fetched ``chunk_size`` bytes at a time with
ranged reads into its sparse cache file; sequential readers get the next ``READAHEAD``
chunks fetched ahead, in parallel.  Never one under-storage request per small read.

Two ways to use it:

- ``read`` (a reader's READ): each fetched chunk is held in memory and the reader is
  served from there at once, while a writer thread writes the chunk into the cache file
  behind it (write-behind).  Memory is bounded: at most ``BUFFER`` bytes of chunks are
  held (the oldest chunks already written go first), at most ``WRITE_BEHIND`` of them not
  yet written.  When the copy falls that far behind, a fetcher either waits for it
  (``lag_ok=False``: every chunk fetched ends up in the copy) or leaves that chunk out of
  the copy (``lag_ok=True``: the copy is a cache of a file another node holds; a later
  read fetches the chunk again).
- ``ensure`` / ``fetch_all``: the bytes are in the cache file when it returns.

A chunk counts as present only once its bytes are written to the cache file, and a file
is reported whole only when every chunk is present: a copy is never taken for the whole
generation before it is.  Which chunks are present is kept in memory; after a restart a
partial file is fetched again.

A chunk's bytes count in the cache's use (``CacheDir.filled``) from the moment room is made
for it, before its fetch: chunks fetched but not yet written (up to WRITE_BEHIND of them) are
room taken, so the cache never fills past its limit behind the accounting's back.  A chunk
that fails, or is left out of the copy, is taken off again.

Lock: ``ReadThrough._lock`` (a Condition) guards every _Fill and the memory accounting;
nothing blocking (a fetch, a pwrite, a pread) runs under it.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from acache.data.under.base import UnderStore
from acache.errors import FsError, UnderStoreError

log = logging.getLogger("acache.readthrough")
READAHEAD = 4                 # chunks fetched ahead of a sequential reader
BUFFER = 128 << 20            # bytes of fetched chunks held in memory, all files together
WRITE_BEHIND = 64 << 20       # ... of them not yet written to their cache file
WHOLE_KEPT = 4096             # files made whole, remembered (until forget) for late readers
SPARE = 4                     # chunk buffers kept for reuse (ReadThrough.buffer)


class _Fill:
    def __init__(self, size: int, chunk: int) -> None:
        self.present: set[int] = set()      # written to the cache file
        self.loading: dict[int, threading.Event] = {}   # being fetched (set: fetched or failed)
        self.mem: dict[int, bytes | bytearray] = {}     # fetched, held in memory
        self.unwritten: set[int] = set()    # in mem, queued for (or in) the write-behind
        self.nchunks = (size + chunk - 1) // chunk
        self.errors: dict[int, Exception] = {}


class ReadThrough:
    def __init__(self, under: UnderStore, chunk_size: int, workers: int = 8,
                 cache=None, lag_ok: bool = False) -> None:
        self.under = under
        self.cache = cache         # a CacheDir: room is made and fetched bytes accounted there
        self.chunk = chunk_size
        self.lag_ok = lag_ok
        # waits for the under-storage and the metadata to agree where files are (the
        # persister's wait_moves): a fetch that found nothing tries again after it
        self.settle: Callable[[], object] | None = None
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="acache-fetch")
        self._fills: dict[tuple[int, int], _Fill] = {}
        self._lock = threading.Condition()
        self._lru: collections.OrderedDict[tuple[int, int, int], _Fill] = collections.OrderedDict()
        self._mem_bytes = 0
        self._backlog = 0          # bytes queued for the write-behind (or being written)
        self._queue: collections.deque = collections.deque()
        self._writer: threading.Thread | None = None
        self._spare: list[bytearray] = []
        # files made whole lately: a reader that was already on its way (the kernel sends
        # several READs at once) reads the copy instead of starting the fetch over
        self._whole: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
        self.requests = 0          # under-storage reads made (status: ufs_reads)
        self.bytes_read = 0
        self.hits = 0              # chunks a read needed that were in the cache already
        self.misses = 0            # ... that had to be fetched (or were being fetched)
        self.copy_skipped = 0      # bytes fetched and served but left out of the copy (lag_ok)

    def forget(self, ino: int, gen: int) -> None:
        with self._lock:
            self._whole.pop((ino, gen), None)
            fill = self._fills.pop((ino, gen), None)
            if fill is not None:
                self._drop_mem(ino, gen, fill)

    # -- a reader's READ: served from memory where the chunk is ------------------------------
    def read(self, ino: int, gen: int, fd: int, upath, size: int, offset: int, length: int,
             reader=None, wait: bool = True):
        """Bytes [offset, offset+length) of the file (clipped at ``size``): from the chunks
        held in memory, else from the cache file ``fd``; missing chunks are fetched (and the
        next READAHEAD ones).  Returns ``(data, whole)``: ``whole`` once every chunk is in the
        cache file.  With ``wait=False``: None instead of waiting for a fetch."""
        end = min(size, offset + length)
        fill = self._fill(ino, gen, size)
        if fill is None:
            return os.pread(fd, max(0, end - offset), offset), True
        if end <= offset:
            return b"", self._done(ino, gen, fill)
        first, last = offset // self.chunk, (end - 1) // self.chunk
        wanted = range(first, min(last + 1 + READAHEAD, fill.nchunks))
        waits = [self._start(fill, ino, gen, fd, upath, size, c, reader, True) for c in wanted]
        needed = waits[:last + 1 - first]
        missed = sum(1 for ev in needed if ev is not None)
        with self._lock:
            self.misses += missed
            self.hits += len(needed) - missed
        if not wait and missed:
            return None
        pieces = []
        for c, ev in zip(range(first, last + 1), needed):
            piece = self._piece(fill, ino, gen, fd, upath, size, c, max(offset, c * self.chunk),
                                min(end, (c + 1) * self.chunk), ev, reader, wait)
            if piece is None:
                return None
            pieces.append(piece)
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        return data, self._done(ino, gen, fill)

    def _piece(self, fill: _Fill, ino, gen, fd, upath, size, c: int, lo: int, hi: int, ev,
               reader, wait: bool = True):
        base = c * self.chunk
        for _ in range(2):
            if ev is not None:
                ev.wait()
            with self._lock:
                buf = fill.mem.get(c)
                if buf is not None:
                    self._lru.move_to_end((ino, gen, c), last=True)
                    return memoryview(buf)[lo - base:hi - base]
                ok, err = c in fill.present, fill.errors.get(c)
            if ok:
                return os.pread(fd, hi - lo, lo)
            if err is not None:
                log.error("read-through of %s failed: %s", upath(), err)
                raise FsError(5, str(err))
            # fetched, then dropped from memory (and left out of the copy) before we got to it
            ev = self._start(fill, ino, gen, fd, upath, size, c, reader, True)
            if not wait:
                return None
        # dropped again (memory is short: many readers at once): these bytes alone, uncached
        try:
            with self._lock:
                self.requests += 1
            data = reader(lo, hi - lo) if reader is not None else self.under.read(upath(), lo, hi - lo)
        except UnderStoreError as e:
            log.error("read-through of %s failed: %s", upath(), e)
            raise FsError(5, str(e)) from None
        if len(data) != hi - lo:
            raise FsError(5, f"short read of {upath()} at {lo}: {len(data)} of {hi - lo} bytes")
        return data

    def _fill(self, ino: int, gen: int, size: int) -> _Fill | None:
        """The fill of (ino, gen); None if it was made whole lately."""
        with self._lock:
            fill = self._fills.get((ino, gen))
            if fill is None:
                if (ino, gen) in self._whole:
                    return None
                fill = self._fills[(ino, gen)] = _Fill(size, self.chunk)
            return fill

    def _done(self, ino: int, gen: int, fill: _Fill) -> bool:
        with self._lock:
            done = len(fill.present) >= fill.nchunks
            if done and self._fills.get((ino, gen)) is fill:
                del self._fills[(ino, gen)]
                self._drop_mem(ino, gen, fill)
                self._whole[(ino, gen)] = None
                if len(self._whole) > WHOLE_KEPT:
                    self._whole.popitem(last=False)
        return done

    # -- bytes in the cache file on return ---------------------------------------------------
    def ensure(self, ino: int, gen: int, fd: int, upath, size: int, offset: int, length: int,
               readahead: bool = True, reader=None) -> bool:
        """Make bytes [offset, offset+length) of the file present in ``fd``.
        ``upath`` is a callable giving the current under-storage path.  ``reader(offset, n)``
        (if given) reads the bytes from elsewhere instead (a peer's cache, in a cluster).
        Returns True once the whole file is present."""
        end = min(size, offset + length)
        fill = self._fill(ino, gen, size)
        if fill is None:
            return True
        if end > offset:
            first, last = offset // self.chunk, (end - 1) // self.chunk
            wanted = list(range(first, last + 1))
            if readahead:
                wanted += [c for c in range(last + 1, min(last + 1 + READAHEAD, fill.nchunks))]
            waits = [self._start(fill, ino, gen, fd, upath, size, c, reader, False) for c in wanted]
            missed = sum(1 for c, ev in zip(wanted, waits) if c <= last and ev is not None)
            with self._lock:
                self.misses += missed
                self.hits += last + 1 - first - missed
            for c, ev in zip(wanted, waits):
                if c > last:
                    break
                self._written(fill, ino, gen, fd, upath, size, c, ev, reader)
        return self._done(ino, gen, fill)

    def _written(self, fill: _Fill, ino, gen, fd, upath, size, c: int, ev, reader) -> None:
        for _ in range(3):
            if ev is not None:
                ev.wait()
            # presence, not the absence of an error: several readers may wait for one
            # chunk, and each must see its failure (the next _start clears it)
            with self._lock:
                while c in fill.unwritten:        # fetched by a reader: its write is queued
                    self._lock.wait()
                ok, err = c in fill.present, fill.errors.get(c)
            if ok:
                return
            if err is not None:
                break
            ev = self._start(fill, ino, gen, fd, upath, size, c, reader, False)  # left out
        log.error("read-through of %s failed: %s", upath(), err)
        raise FsError(5, str(err or f"chunk {c} was not loaded"))

    def fetch_all(self, ino, gen, fd, upath, size, reader=None) -> None:
        self.ensure(ino, gen, fd, upath, size, 0, size, readahead=False, reader=reader)

    # -- fetching ------------------------------------------------------------------------------
    def _start(self, fill: _Fill, ino, gen, fd, upath, size, c: int, reader=None,
               behind: bool = False):
        """None if chunk ``c`` is there (in the copy; with ``behind``, in memory too), else
        the event of its fetch (started here if none runs)."""
        with self._lock:
            if c in fill.present or (behind and c in fill.mem):
                return None
            ev = fill.loading.get(c)
            if ev is not None:
                return ev
            fill.errors.pop(c, None)   # an earlier failure (a read-ahead nobody waited for)
            ev = fill.loading[c] = threading.Event()
        # our own descriptor: the caller's may be closed before a read-ahead lands
        self.pool.submit(self._load, fill, os.dup(fd), upath, size, c, ev, ino, gen, reader,
                         behind)
        return ev

    def _load(self, fill: _Fill, fd, upath, size, c: int, ev: threading.Event, ino: int = 0,
              gen: int = 0, reader=None, behind: bool = False) -> None:
        off = c * self.chunk
        n = min(self.chunk, size - off)
        held = False           # n bytes counted in the cache's use, not yet written
        try:
            if self.cache is not None:
                self.cache.make_room(n)
                self.cache.filled(ino, gen, n)
                held = True
            data = b""
            for attempt in range(3):       # a rename may move the object under us
                where = upath()
                try:
                    with self._lock:
                        self.requests += 1
                    data = reader(off, n) if reader is not None else self.under.read(where, off, n)
                    with self._lock:
                        self.bytes_read += len(data)
                    break
                except UnderStoreError:
                    if attempt == 2:
                        raise
                    if reader is None and self.settle is not None and upath() == where:
                        self.settle()      # a rename being applied: where it is once done
            if len(data) != n:
                raise UnderStoreError(f"short read of {upath()} at {off}: {len(data)} of {n} bytes "
                                      "(changed in the under-storage?)", retryable=False)
            if behind:
                held = False               # the write-behind's now (or let go if left out)
                self._hand_over(fill, fd, c, off, data, ino, gen, ev)
                fd = -1                    # the write-behind closes it
                return
            self._write(fd, off, data)
            held = False
            with self._lock:
                fill.present.add(c)
                fill.errors.pop(c, None)
        except Exception as e:
            with self._lock:
                fill.errors[c] = e
            if held:
                self._not_written(ino, gen, n)
        finally:
            if fd >= 0:
                os.close(fd)
            with self._lock:
                if fill.loading.get(c) is ev:
                    fill.loading.pop(c, None)
            ev.set()

    def _not_written(self, ino: int, gen: int, n: int) -> None:
        """A chunk counted in the cache's use when its fetch began is not in the copy."""
        if self.cache is not None:
            self.cache.filled(ino, gen, -n)

    @staticmethod
    def _write(fd: int, off: int, data) -> None:
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], off + done)

    # -- memory and the write-behind -----------------------------------------------------------
    def _hand_over(self, fill: _Fill, fd: int, c: int, off: int, data, ino: int, gen: int,
                   ev: threading.Event) -> None:
        """Chunk ``c`` is fetched: readers take it from memory from now on; its write to the
        copy is queued (or, with lag_ok and the write-behind full, left out)."""
        n = len(data)
        with self._lock:
            fill.mem[c] = data
            fill.errors.pop(c, None)
            self._lru[(ino, gen, c)] = fill
            self._lru.move_to_end((ino, gen, c), last=True)
            self._mem_bytes += n
            fill.loading.pop(c, None)
            queue = not self.lag_ok or self._backlog + n <= WRITE_BEHIND
            if queue:
                fill.unwritten.add(c)
            self._trim()
        ev.set()                                   # the readers go on now
        if not queue:
            with self._lock:
                self.copy_skipped += n
            self._not_written(ino, gen, n)
            os.close(fd)
            return
        with self._lock:
            while self._backlog and self._backlog + n > WRITE_BEHIND:   # not lag_ok: wait
                self._lock.wait()
            self._backlog += n
            self._queue.append((fill, fd, c, off, data, ino, gen))
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                                name="acache-fetch-wb")
                self._writer.start()
            self._lock.notify_all()

    def _write_loop(self) -> None:
        if self.lag_ok:
            # the copy may lag (it is a cache): on a busy host the readers' threads come first
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except OSError:
                pass
        while True:
            with self._lock:
                while not self._queue:
                    self._lock.wait()
                fill, fd, c, off, data, ino, gen = self._queue.popleft()
            ok = False
            try:
                self._write(fd, off, data)
                ok = True
            except Exception as e:      # the reader had its bytes; the copy lacks the chunk
                log.warning("read-through: writing chunk %d of inode %d to its copy: %s",
                            c, ino, e)
                self._not_written(ino, gen, len(data))
            finally:
                os.close(fd)
                with self._lock:
                    if ok:
                        fill.present.add(c)
                    fill.unwritten.discard(c)
                    if fill.mem.get(c) is not data:       # dropped from memory meanwhile
                        self._recycle(data)
                    self._backlog -= len(data)
                    self._trim()
                    self._lock.notify_all()

    def _trim(self) -> None:
        """Under the lock: drop the oldest written chunks until at most BUFFER bytes are held."""
        if self._mem_bytes <= BUFFER:
            return
        for key in list(self._lru):
            if self._mem_bytes <= BUFFER:
                break
            fill = self._lru[key]
            if key[2] in fill.unwritten:
                continue
            del self._lru[key]
            buf = fill.mem.pop(key[2])
            self._mem_bytes -= len(buf)
            self._recycle(buf)

    def _drop_mem(self, ino: int, gen: int, fill: _Fill) -> None:
        """Under the lock: let go of ``fill``'s chunks in memory (the write-behind keeps its own
        reference to those still queued)."""
        for c in list(fill.mem):
            if self._lru.get((ino, gen, c)) is fill:
                del self._lru[(ino, gen, c)]
            buf = fill.mem.pop(c)
            self._mem_bytes -= len(buf)
            if c not in fill.unwritten:        # else the write-behind recycles it
                self._recycle(buf)

    def buffer(self, n: int) -> bytearray:
        """A buffer for a reader to fetch ``n`` bytes into: a chunk's buffer used before if
        one is spare (fresh memory costs a page fault per page, a reused buffer none)."""
        if n == self.chunk:
            with self._lock:
                if self._spare:
                    return self._spare.pop()
        return bytearray(n)

    def _recycle(self, buf) -> None:
        """Under the lock: keep a chunk's buffer that nothing uses any more for the next fetch."""
        if type(buf) is not bytearray or len(buf) != self.chunk or len(self._spare) >= SPARE:
            return
        try:               # a memoryview of it still held somewhere (a reply being sent)?
            buf.append(0)
            buf.pop()
        except BufferError:
            return
        self._spare.append(buf)
