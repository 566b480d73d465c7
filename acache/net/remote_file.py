"""A remote file read over any Conn: ``pread``/``readinto`` at an offset.

The serving op answers ``{**meta, "offset": o, "length": n}`` with at most n bytes of the file
from o (fewer only at its end), e.g. a FileRegion.  A read is cut at ``chunk`` boundaries and
the pieces are fetched in parallel (``parallel`` at once; the Conn spreads them over its
streams).  A sequential reader (each read starting where the last ended) goes through a small
chunk cache and gets the next ``readahead`` chunks fetched ahead of it; a random reader's
pieces land straight in its buffer.  Errors of a prefetched chunk surface when it is read
(and it is fetched again next time).
"""
from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol


class ReadsInto(Protocol):
    """All a RemoteFile asks of its Conn (acache.net.transport.Conn): ``read_into``.  Any
    Conn is one; so is an adapter reading ranges elsewhere (acache.cluster.cacheless reads
    the under-storage through one)."""

    def read_into(self, op: str, meta: dict, buf: memoryview, *,
                  timeout: float | None = None) -> int: ...


class RemoteFile:
    def __init__(self, conn: ReadsInto, op: str, meta: dict, size: int, *, chunk: int = 8 << 20,
                 parallel: int = 4, readahead: int = 4, timeout: float | None = None) -> None:
        self.conn, self.op, self.meta, self.size = conn, op, dict(meta), size
        self.chunk, self.readahead, self.timeout = chunk, readahead, timeout
        self._pool = ThreadPoolExecutor(max(1, parallel), thread_name_prefix="acache-remote-file")
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, Future] = OrderedDict()   # chunk index -> (buf, n)
        self._next = 0                                           # where a sequential read starts
        self._spent: list[bytearray] = []    # chunk buffers dropped from the cache, to reuse
        self.stats = {"hits": 0, "misses": 0, "prefetched": 0, "direct": 0}

    def _fetch_into(self, offset: int, buf: memoryview) -> int:
        return self.conn.read_into(self.op, {**self.meta, "offset": offset, "length": len(buf)},
                                   buf, timeout=self.timeout)

    def _buffer(self, n: int) -> bytearray:
        """A chunk buffer: a spent one nobody looks at any more (no view of it from pread is
        alive: CPython's refcount says so), else a new one.  Fresh 8 MiB buffers cost a memset
        and page faults, a fair part of the time of a fast link."""
        with self._lock:
            for i, b in enumerate(self._spent):
                # refs: the list, the loop variable, getrefcount's argument
                if len(b) == n and sys.getrefcount(b) <= 3:
                    return self._spent.pop(i)
            del self._spent[:-2 * (self.readahead + 2)]
        return bytearray(n)

    def _fetch_chunk(self, idx: int) -> tuple[bytearray, int]:
        off = idx * self.chunk
        buf = self._buffer(min(self.chunk, self.size - off))
        return buf, self._fetch_into(off, memoryview(buf))

    def _forget(self, idx: int) -> None:
        """Drop chunk ``idx`` from the cache (lock held); its buffer may be reused."""
        f = self._cache.pop(idx)
        if f.done() and not f.cancelled() and f.exception() is None:
            self._spent.append(f.result()[0])

    def _chunk(self, idx: int, prefetch: bool = False) -> Future:
        """The (maybe running) fetch of chunk ``idx`` (lock held)."""
        f = self._cache.get(idx)
        if f is None:
            f = self._pool.submit(self._fetch_chunk, idx)
            self._cache[idx] = f
            self.stats["prefetched" if prefetch else "misses"] += 1
        elif not prefetch:
            self.stats["hits"] += 1
        return f

    def _ahead(self, first: int, last: int) -> None:
        """Fetch the chunks after ``last``; forget those before ``first`` (lock held)."""
        for i in range(last + 1, min(last + 1 + self.readahead, (self.size + self.chunk - 1) // self.chunk)):
            self._chunk(i, prefetch=True)
        for i in [i for i in self._cache if i < first]:   # consumed: behind the reader
            self._forget(i)
        while len(self._cache) > last - first + 1 + self.readahead:
            self._forget(next(iter(self._cache)))

    def readinto(self, offset: int, buf: memoryview | bytearray) -> int:
        out = memoryview(buf).cast("B")
        n = max(0, min(len(out), self.size - offset))
        if n == 0:
            return 0
        first, last = offset // self.chunk, (offset + n - 1) // self.chunk
        with self._lock:
            sequential = offset == self._next
            self._next = offset + n
            if sequential:
                futs = [(i, self._chunk(i)) for i in range(first, last + 1)]
                self._ahead(first, last)
        if sequential:
            got = 0
            for i, f in futs:
                try:
                    cbuf, cn = f.result()
                except BaseException:
                    with self._lock:
                        if self._cache.get(i) is f:
                            del self._cache[i]
                    raise
                lo = max(offset, i * self.chunk)
                hi = min(offset + n, i * self.chunk + cn)
                if hi <= lo:
                    break
                out[lo - offset:hi - offset] = memoryview(cbuf)[lo - i * self.chunk:hi - i * self.chunk]
                got = hi - offset
                if cn < len(cbuf):     # the file ended early
                    break
            return got
        # random access: the pieces straight into the caller's buffer, in parallel
        pieces = []
        for i in range(first, last + 1):
            lo, hi = max(offset, i * self.chunk), min(offset + n, (i + 1) * self.chunk)
            pieces.append((lo, hi, self._pool.submit(self._fetch_into, lo, out[lo - offset:hi - offset])))
        self.stats["direct"] += len(pieces)
        got, short = 0, False
        for lo, hi, f in pieces:       # wait for all (they write into ``out``) before returning
            try:
                k = f.result()
            except BaseException:
                for _, _, g in pieces:
                    g.cancel()
                    try:
                        g.exception()
                    except BaseException:
                        pass
                raise
            if not short:
                got = lo - offset + k
                short = k < hi - lo
        return got

    def pread(self, offset: int, n: int) -> memoryview:
        """Up to ``n`` bytes at ``offset`` (fewer only at the end), read-only.  A sequential read
        within one chunk is a view of the fetched chunk itself: no copy at all."""
        n = max(0, min(n, self.size - offset))
        idx = offset // self.chunk
        if n and offset == self._next and (offset + n - 1) // self.chunk == idx:
            with self._lock:
                f = self._cache.get(idx)
            if f is not None and f.done() and f.exception() is None:
                cbuf, cn = f.result()
                lo = offset - idx * self.chunk
                view = memoryview(cbuf)[lo:min(lo + n, cn)].toreadonly()
                with self._lock:
                    self._next = offset + len(view)
                    self.stats["hits"] += 1
                    self._ahead(idx, idx)
                return view
        buf = bytearray(n)
        return memoryview(buf)[:self.readinto(offset, buf)].toreadonly()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._cache.clear()
