"""ReadThrough.read: readers are served from the fetched chunk in memory while its copy is
written behind; the copy is whole (and reported whole) only once every chunk is written;
memory stays bounded, and chunks dropped from it or left out of the copy are fetched again."""
from __future__ import annotations

import os
import random
import threading
import time

import pytest

from acache.data import readthrough
from acache.data.readthrough import ReadThrough
from acache.errors import FsError, UnderStoreError

CHUNK = 64 << 10


def _poll(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def copy(tmp_path):
    fd = os.open(tmp_path / "copy", os.O_RDWR | os.O_CREAT, 0o600)
    yield fd
    os.close(fd)


def test_read_served_while_the_copy_is_written_behind(copy):
    data = os.urandom(4 * CHUNK + 123)
    gate = threading.Event()
    rt = ReadThrough(None, CHUNK)
    plain_write = rt._write

    def slow_write(fd, off, buf):      # the copy's disk is slow: every write waits
        gate.wait(10)
        plain_write(fd, off, buf)
    rt._write = slow_write             # type: ignore[method-assign]
    try:
        reader = lambda off, n: data[off:off + n]   # noqa: E731
        for off, n in [(0, 4096), (CHUNK - 10, 20), (3 * CHUNK, 2 * CHUNK), (5, 4 * CHUNK)]:
            got, whole = rt.read(1, 1, copy, lambda: "f", len(data), off, n, reader=reader)
            assert bytes(got) == data[off:off + n]
            assert whole is False
        assert os.fstat(copy).st_size == 0          # nothing written yet: served from memory
        gate.set()
        _poll(lambda: not rt._backlog)
        got, whole = rt.read(1, 1, copy, lambda: "f", len(data), 0, len(data), reader=reader)
        assert whole is True and bytes(got) == data
        assert os.pread(copy, len(data) + 1, 0) == data       # the copy is complete
        assert rt._mem_bytes == 0                            # and memory let go
    finally:
        gate.set()
        rt.pool.shutdown()


def test_ensure_waits_for_a_chunk_a_reader_fetched(copy):
    """fetch_all after a read: it returns only once the write-behind put the bytes in fd."""
    data = os.urandom(3 * CHUNK)
    gate = threading.Event()
    rt = ReadThrough(None, CHUNK)
    plain_write = rt._write

    def slow_write(fd, off, buf):
        gate.wait(10)
        plain_write(fd, off, buf)
    rt._write = slow_write             # type: ignore[method-assign]
    reader = lambda off, n: data[off:off + n]   # noqa: E731
    try:
        rt.read(1, 1, copy, lambda: "f", len(data), 0, 1, reader=reader)
        done = threading.Event()
        t = threading.Thread(target=lambda: (rt.fetch_all(1, 1, copy, lambda: "f", len(data),
                                                          reader=reader), done.set()))
        t.start()
        assert not done.wait(0.3)       # chunk 0 is in memory only: fetch_all waits for it
        gate.set()
        t.join(10)
        assert done.is_set()
        assert os.pread(copy, len(data), 0) == data
    finally:
        gate.set()
        rt.pool.shutdown()


def test_random_and_backward_reads_with_little_memory(copy, monkeypatch):
    """Two chunks of memory, one of write-behind, the copy allowed to lag: chunks are left
    out of the copy and dropped from memory under the readers' feet; every read still gets
    exactly its bytes, and the copy is never reported whole while it has a hole."""
    monkeypatch.setattr(readthrough, "BUFFER", 2 * CHUNK)
    monkeypatch.setattr(readthrough, "WRITE_BEHIND", CHUNK)
    data = os.urandom(16 * CHUNK - 77)
    rt = ReadThrough(None, CHUNK, workers=4, lag_ok=True)
    calls = []

    def reader(off: int, n: int):
        calls.append((off, n))
        time.sleep(0.001)
        buf = rt.buffer(n)             # recycled buffers: none reused while a reader has it
        buf[:] = data[off:off + n]
        return buf
    rng = random.Random(7)
    try:
        offsets = list(range(len(data) - 4096, -1, -50_000))        # backwards
        offsets += [rng.randrange(len(data)) for _ in range(200)]   # random
        lock = threading.Lock()
        bad = []

        def run(offs):
            for off in offs:
                n = rng.choice([1, 4096, CHUNK, 3 * CHUNK + 5])
                got, whole = rt.read(1, 1, copy, lambda: "f", len(data), off, n, reader=reader)
                if bytes(got) != data[off:off + n]:
                    with lock:
                        bad.append((off, n))
                if whole:     # reported whole: the copy must be exactly the file
                    if os.pread(copy, len(data) + 1, 0) != data:
                        with lock:
                            bad.append(("whole but not", off))
        ts = [threading.Thread(target=run, args=(offsets[i::3],)) for i in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not bad, bad[:5]
        assert rt.copy_skipped > 0 and len(calls) > 16      # the hard paths were taken
        assert rt._mem_bytes <= readthrough.BUFFER + CHUNK
        _poll(lambda: not rt._backlog)
        fill = rt._fills.get((1, 1))
        if fill is not None:      # what the copy holds is right, chunk by chunk
            for c in sorted(fill.present):
                off = c * CHUNK
                assert os.pread(copy, CHUNK, off) == data[off:off + CHUNK]
        # filling the holes makes the copy whole
        rt.fetch_all(1, 1, copy, lambda: "f", len(data), reader=reader)
        assert os.pread(copy, len(data) + 1, 0) == data
    finally:
        rt.pool.shutdown()


def test_read_of_an_unreachable_source_is_eio(copy):
    def reader(off: int, n: int) -> bytes:
        raise UnderStoreError("peer gone", retryable=False)
    rt = ReadThrough(None, CHUNK)
    try:
        with pytest.raises(FsError) as e:
            rt.read(1, 1, copy, lambda: "f", 4 * CHUNK, CHUNK, 10, reader=reader)
        assert e.value.errno == 5
        # ... and the next read tries again (and works once the source answers)
        got, _ = rt.read(1, 1, copy, lambda: "f", 4 * CHUNK, CHUNK, 10,
                         reader=lambda off, n: b"y" * n)
        assert bytes(got) == b"y" * 10
    finally:
        rt.pool.shutdown()


def test_chunks_not_yet_written_count_in_the_cache_limit(tmp_path):
    """A chunk takes room from the moment its fetch starts: while the write-behind lags,
    read-through evicts clean files for the chunks it holds, and the cache's use never
    runs past its limit by more than the chunks being fetched."""
    from acache.data.cache import CacheDir
    cache = CacheDir(str(tmp_path / "cache"), 4 * CHUNK, 5)
    evicted = []

    class Evictor:
        def evict_cached(self, ino, gen):
            evicted.append(ino)
            cache.remove(ino, gen)
            return True
    cache.attach(Evictor())
    for ino in (10, 11):                   # two clean files fill the cache
        with open(cache.path(ino, 1), "wb") as f:
            f.write(os.urandom(2 * CHUNK))
        cache.note(ino, 1, dirty=False)
    assert cache.used() >= 4 * CHUNK
    data = os.urandom(8 * CHUNK)
    fd = os.open(cache.path(1, 1), os.O_RDWR | os.O_CREAT, 0o600)
    gate = threading.Event()
    rt = ReadThrough(None, CHUNK, cache=cache)
    plain_write = rt._write
    peak = []

    def slow_write(fd, off, buf):          # the copy's disk lags: nothing written yet
        gate.wait(10)
        plain_write(fd, off, buf)
        peak.append(cache.used())
    rt._write = slow_write                 # type: ignore[method-assign]
    try:
        reader = lambda off, n: data[off:off + n]   # noqa: E731
        got, _ = rt.read(1, 1, fd, lambda: "f", len(data), 0, CHUNK, reader=reader)
        assert bytes(got) == data[:CHUNK]
        _poll(lambda: not rt._fills[(1, 1)].loading)
        held = 1 + readthrough.READAHEAD          # chunks fetched, in memory, unwritten
        assert os.fstat(fd).st_size == 0
        assert cache.used() == held * CHUNK, "fetched chunks not counted before their write"
        assert sorted(evicted) == [10, 11], "no room was made for the fetched chunks"
        gate.set()
        for off in range(CHUNK, len(data), CHUNK):
            got, _ = rt.read(1, 1, fd, lambda: "f", len(data), off, CHUNK, reader=reader)
            assert bytes(got) == data[off:off + CHUNK]
        _poll(lambda: not rt._backlog)
        assert os.pread(fd, len(data) + 1, 0) == data
        assert cache.used() == len(data)           # counted once, not again when written
        assert max(peak) <= len(data)
    finally:
        gate.set()
        rt.pool.shutdown()
        os.close(fd)
