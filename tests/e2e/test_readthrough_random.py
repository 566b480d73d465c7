"""Read-through under eviction, random operations from several threads at once.

A cache a few chunks big over an under-storage of files several times its size: every
read is likely to fetch (the file was evicted, or never read), chunks are served from
memory while their copy is written behind, clean files are evicted to make room for the
chunks being fetched, and files are overwritten, truncated and renamed meanwhile.  Each
operation is checked against a model of what every file holds; the page cache is dropped
for a file before it is read (POSIX_FADV_DONTNEED), so reads reach the daemon.  At the
end: every file reads back as the model says, through the mount and in the under-storage
after `flush --wait`, and the cache stayed within its limit plus the chunks in flight.
"""
from __future__ import annotations

import os
import random
import threading

import pytest

from tests.e2e.conftest import ENGINES, engine_fixture

MiB = 1 << 20
CHUNK = 1 * MiB
LIMIT = 8 * MiB
engine = engine_fixture(ENGINES)


class _RW:
    """Readers share a file, a writer has it alone (the model is exact per file)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.readers = 0
        self.writer = False

    def read(self):
        return _Hold(self, False)

    def write(self):
        return _Hold(self, True)


class _Hold:
    def __init__(self, rw: _RW, exclusive: bool) -> None:
        self.rw, self.exclusive = rw, exclusive

    def __enter__(self):
        with self.rw.cond:
            if self.exclusive:
                while self.rw.writer or self.rw.readers:
                    self.rw.cond.wait()
                self.rw.writer = True
            else:
                while self.rw.writer:
                    self.rw.cond.wait()
                self.rw.readers += 1

    def __exit__(self, *exc):
        with self.rw.cond:
            if self.exclusive:
                self.rw.writer = False
            else:
                self.rw.readers -= 1
            self.rw.cond.notify_all()


def _drop(fd: int) -> None:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


@pytest.mark.e2e
@pytest.mark.parametrize("seed", [1, 2])
def test_random_reads_overwrites_and_renames_under_eviction(make_node, seed):
    rng = random.Random(seed)
    node = make_node(start=False, flush_delay=0.05,
                     extra_env={"ACACHE_CACHE_SIZE": str(LIMIT), "ACACHE_CHUNK_SIZE": str(CHUNK)})
    names = [f"d{i % 3}/f{i}.bin" for i in range(10)]
    model: dict[str, bytes] = {}
    for name in names:     # 10 files, 1-5 MiB each (odd sizes): ~3-4x the cache
        data = rng.randbytes(rng.randrange(1 * MiB, 5 * MiB) + rng.randrange(4096))
        (node.ufs_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (node.ufs_dir / name).write_bytes(data)
        model[name] = data
    node.start()
    slots = list(names)            # slot i: the name file i has now (renames move it)
    history: list[list[str]] = [[f"ufs {len(model[n])}"] for n in names]   # for the report
    versions: list[list[bytes]] = [[model[n]] for n in names]
    locks = [_RW() for _ in slots]
    errors: list[str] = []
    peak = [0]

    def op(t: int, k: int, r: random.Random) -> None:
        i = r.randrange(len(slots))
        what = r.random()
        if what < 0.55:             # a range, or the whole file
            with locks[i].read():
                name = slots[i]
                want = model[name]
                fd = os.open(node.mnt / name, os.O_RDONLY)
                try:
                    _drop(fd)
                    if r.random() < 0.3:
                        off, n = 0, len(want) + 1
                    else:
                        off = r.randrange(len(want) + 1)
                        n = r.choice([1, 4096, 65536, CHUNK, 3 * CHUNK + 7])
                    got = os.pread(fd, n, off)
                    if n > len(want):     # the whole file in one read may come short: go on
                        while len(got) < len(want) - off:
                            more = os.pread(fd, n, off + len(got))
                            if not more:
                                break
                            got += more
                finally:
                    os.close(fd)
                if got != want[off:off + n]:
                    older = [j for j, v in enumerate(versions[i]) if v[off:off + n] == got]
                    j0 = _diff(got, want[off:off + n])
                    probe = got[j0:j0 + 64]
                    found = [(s2, j, v.find(probe)) for s2, vs in enumerate(versions)
                             for j, v in enumerate(vs) if len(probe) == 64 and probe in v]
                    older.append(("bytes at the difference found in (slot, version, offset)",
                                  found, "zeros" if probe.count(0) == len(probe) else ""))
                    errors.append(f"t{t} op{k}: read {name} [{off}, +{n}): {len(got)} bytes, "
                                  f"first difference at {_diff(got, want[off:off + n])}; "
                                  f"what was read is version {older} of {history[i]}")
        elif what < 0.8:            # overwrite: whole, or a part in place
            with locks[i].write():
                name = slots[i]
                old = model[name]
                if r.random() < 0.5:
                    new = r.randbytes(r.randrange(0, 4 * MiB))
                    with open(node.mnt / name, "wb") as f:
                        f.write(new)
                else:
                    off = r.randrange(len(old) + 1)
                    piece = r.randbytes(r.randrange(1, 2 * CHUNK))
                    fd = os.open(node.mnt / name, os.O_WRONLY)
                    try:
                        os.pwrite(fd, piece, off)
                    finally:
                        os.close(fd)
                    new = old[:off] + piece + old[off + len(piece):]
                model[name] = new
                history[i].append(f"t{t}.{k} write {len(new)}")
                versions[i].append(new)
        elif what < 0.9:            # truncate
            with locks[i].write():
                name = slots[i]
                n = r.randrange(len(model[name]) + 2 * CHUNK)
                os.truncate(node.mnt / name, n)
                old = model[name]
                model[name] = old[:n] + b"\0" * max(0, n - len(old))
                history[i].append(f"t{t}.{k} truncate {n}")
                versions[i].append(model[name])
        else:                       # rename into another directory (a new name)
            with locks[i].write():
                name = slots[i]
                dst = f"d{r.randrange(3)}/r{t}.{k}.bin"
                os.rename(node.mnt / name, node.mnt / dst)
                model[dst] = model.pop(name)
                slots[i] = dst
                history[i].append(f"t{t}.{k} rename {name} -> {dst}")
        if k % 8 == 7:              # `status` is a CLI call: a sample, not every op
            peak[0] = max(peak[0], node.status()["cache_used"])

    def worker(t: int) -> None:
        r = random.Random(seed * 100 + t)
        try:
            for k in range(60):
                op(t, k, r)
                if errors:
                    return
        except Exception as e:
            errors.append(f"t{t}: {e!r}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)
    assert not any(th.is_alive() for th in threads), "a worker hung"
    assert not errors, "\n".join(errors[:5])
    for name, want in model.items():
        assert (node.mnt / name).read_bytes() == want, name
    node.flush()
    ufs = node.ufs_files()
    assert {k: len(v) for k, v in ufs.items()} == {k: len(v) for k, v in model.items()}
    assert all(ufs[k] == v for k, v in model.items())
    st = node.status()
    assert st["ufs_reads"] > 0, "nothing was read through: the probe tested nothing"
    # open files and dirty data may hold the cache over its limit for a while; clean
    # chunks being fetched count from the start (a few readers x read-ahead)
    assert peak[0] <= LIMIT + 4 * 5 * CHUNK + 4 * 4 * MiB, (peak[0], st)
    assert "Traceback" not in node.log_tail(400)


def _diff(a: bytes, b: bytes) -> int:
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    return min(len(a), len(b))
