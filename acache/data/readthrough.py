"""Read-through: fill a cache file from the under-storage in large chunks.

A file that is in the under-storage but not (wholly) in the cache is fetched
``chunk_size`` bytes at a time with ranged reads into its sparse cache file;
sequential readers get the next chunks fetched ahead, in parallel.  Never one
under-storage request per small read.  Which chunks are present is kept in
memory; after a restart a partial file is fetched again.
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from acache.data.under.base import UnderStore
from acache.errors import FsError, UnderStoreError

log = logging.getLogger("acache.readthrough")
READAHEAD = 4


class _Fill:
    def __init__(self, size: int, chunk: int) -> None:
        self.present: set[int] = set()
        self.loading: dict[int, threading.Event] = {}
        self.nchunks = (size + chunk - 1) // chunk
        self.errors: dict[int, Exception] = {}


class ReadThrough:
    def __init__(self, under: UnderStore, chunk_size: int, workers: int = 8,
                 cache=None) -> None:
        self.under = under
        self.cache = cache         # a CacheDir: room is made and fetched bytes accounted there
        self.chunk = chunk_size
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="acache-fetch")
        self._fills: dict[tuple[int, int], _Fill] = {}
        self._lock = threading.Lock()
        self.requests = 0          # under-storage reads made (status: ufs_reads)
        self.bytes_read = 0
        self.hits = 0              # chunks a read needed that were in the cache already
        self.misses = 0            # ... that had to be fetched (or were being fetched)

    def forget(self, ino: int, gen: int) -> None:
        with self._lock:
            self._fills.pop((ino, gen), None)

    def ensure(self, ino: int, gen: int, fd: int, upath, size: int, offset: int, length: int,
               readahead: bool = True, reader=None) -> bool:
        """Make bytes [offset, offset+length) of the file present in ``fd``.
        ``upath`` is a callable giving the current under-storage path.  ``reader(offset, n)``
        (if given) reads the bytes from elsewhere instead (a peer's cache, in a cluster).
        Returns True once the whole file is present."""
        end = min(size, offset + length)
        with self._lock:
            fill = self._fills.setdefault((ino, gen), _Fill(size, self.chunk))
        if end > offset:
            first, last = offset // self.chunk, (end - 1) // self.chunk
            wanted = list(range(first, last + 1))
            if readahead:
                wanted += [c for c in range(last + 1, min(last + 1 + READAHEAD, fill.nchunks))]
            waits = [self._start(fill, ino, gen, fd, upath, size, c, reader) for c in wanted]
            missed = sum(1 for c, ev in zip(wanted, waits) if c <= last and ev is not None)
            with self._lock:
                self.misses += missed
                self.hits += last + 1 - first - missed
            for c, ev in zip(wanted, waits):
                if c > last:
                    break
                if ev is not None:
                    ev.wait()
                # presence, not the absence of an error: several readers may wait for one
                # chunk, and each must see its failure (the next _start clears it)
                with self._lock:
                    ok, err = c in fill.present, fill.errors.get(c)
                if not ok:
                    log.error("read-through of %s failed: %s", upath(), err)
                    raise FsError(5, str(err or f"chunk {c} was not loaded"))
        with self._lock:
            done = len(fill.present) >= fill.nchunks
            if done:
                self._fills.pop((ino, gen), None)
        return done

    def fetch_all(self, ino, gen, fd, upath, size, reader=None) -> None:
        self.ensure(ino, gen, fd, upath, size, 0, size, readahead=False, reader=reader)

    def _start(self, fill: _Fill, ino, gen, fd, upath, size, c: int, reader=None):
        with self._lock:
            if c in fill.present:
                return None
            ev = fill.loading.get(c)
            if ev is not None:
                return ev
            fill.errors.pop(c, None)   # an earlier failure (a read-ahead nobody waited for)
            ev = fill.loading[c] = threading.Event()
        # our own descriptor: the caller's may be closed before a read-ahead lands
        self.pool.submit(self._load, fill, os.dup(fd), upath, size, c, ev, ino, gen, reader)
        return ev

    def _load(self, fill: _Fill, fd, upath, size, c: int, ev: threading.Event, ino: int = 0,
              gen: int = 0, reader=None) -> None:
        off = c * self.chunk
        n = min(self.chunk, size - off)
        try:
            if self.cache is not None:
                self.cache.make_room(n)
            data = b""
            for attempt in range(3):       # a rename may move the object under us
                try:
                    with self._lock:
                        self.requests += 1
                    data = reader(off, n) if reader is not None else self.under.read(upath(), off, n)
                    with self._lock:
                        self.bytes_read += len(data)
                    break
                except UnderStoreError:
                    if attempt == 2:
                        raise
            if len(data) != n:
                raise UnderStoreError(f"short read of {upath()} at {off}: {len(data)} of {n} bytes "
                                      "(changed in the under-storage?)", retryable=False)
            view = memoryview(data)
            done = 0
            while done < n:
                done += os.pwrite(fd, view[done:], off + done)
            if self.cache is not None:
                self.cache.filled(ino, gen, n)
            with self._lock:
                fill.present.add(c)
                fill.errors.pop(c, None)
        except Exception as e:
            with self._lock:
                fill.errors[c] = e
        finally:
            os.close(fd)
            with self._lock:
                fill.loading.pop(c, None)
            ev.set()
