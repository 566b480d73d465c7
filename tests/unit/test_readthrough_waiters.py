"""Several readers waiting for one chunk whose fetch fails: every one of them gets EIO (none
goes on to read the sparse cache file's hole: a short read, EOF or zeros to the kernel)."""
from __future__ import annotations

import os
import threading


from acache.data.readthrough import ReadThrough
from acache.errors import FsError, UnderStoreError


def test_every_waiter_of_a_failed_chunk_gets_eio(tmp_path):
    gate = threading.Event()
    calls = []

    def reader(off: int, n: int) -> bytes:
        calls.append(off)
        gate.wait(10)
        raise UnderStoreError("peer gone", retryable=True)

    rt = ReadThrough(None, 1 << 20)
    fd = os.open(tmp_path / "copy", os.O_RDWR | os.O_CREAT)
    results: list = []

    def read() -> None:
        try:
            rt.ensure(1, 1, fd, lambda: "f", 4 << 20, 0, 4096, readahead=False, reader=reader)
            results.append("ok")
        except FsError as e:
            results.append(e.errno)
    ts = [threading.Thread(target=read) for _ in range(4)]
    for t in ts:
        t.start()
    while not calls:                       # the fetch is under way; every reader waits for it
        threading.Event().wait(0.01)
    threading.Event().wait(0.2)
    gate.set()
    for t in ts:
        t.join(10)
    os.close(fd)
    assert results == [5, 5, 5, 5], results
    # the chunk is fetched again on the next read, and then it works
    fd = os.open(tmp_path / "copy", os.O_RDWR)
    try:
        assert rt.ensure(1, 1, fd, lambda: "f", 4 << 20, 0, 4 << 20, readahead=False,
                         reader=lambda off, n: b"x" * n) is True
    finally:
        os.close(fd)
    assert (tmp_path / "copy").read_bytes() == b"x" * (4 << 20)
