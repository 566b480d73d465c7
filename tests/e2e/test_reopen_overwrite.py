"""A file reopened for writing and overwritten with as many bytes is journaled at its
close, whatever its (size, mtime) says.  The close of an unchanged file costs no upload,
and "unchanged" was judged by the cache file's (size, mtime) at the last journaled
close; a same-size overwrite whose mtime equals that (within the cache filesystem's
timestamp granularity, or set back by the writer, as `cp -p` and `rsync -t` do) was
never journaled: the under-storage kept the old bytes while `flush --wait` succeeded,
and after the cache was lost the old bytes came back."""
import mmap
import os
import subprocess
import time

import pytest

from tests.e2e.contract_util import pattern

T0 = 1704067200 * 10**9     # 2024-01-01: the mtime both sources share


def test_cp_p_over_same_size_same_mtime_file_lands(make_node, tmp_path):
    """Two checkpoints unpacked from archives made in the same second (same size, same
    mtime, different bytes), copied with `cp -p` one after the other to one name."""
    src = tmp_path / "src"
    src.mkdir()
    a, b = src / "a.bin", src / "b.bin"
    a.write_bytes(pattern(1 << 20, seed=1))
    b.write_bytes(pattern(1 << 20, seed=2))
    for p in (a, b):
        os.utime(p, ns=(T0, T0))
    n = make_node()
    subprocess.run(["cp", "-p", str(a), str(n.mnt / "ckpt.bin")], check=True)
    n.flush()
    assert n.ufs_files() == {"ckpt.bin": a.read_bytes()}
    subprocess.run(["cp", "-p", str(b), str(n.mnt / "ckpt.bin")], check=True)
    assert (n.mnt / "ckpt.bin").read_bytes() == b.read_bytes()
    assert os.stat(n.mnt / "ckpt.bin").st_mtime_ns == T0
    n.flush()
    assert n.ufs_files() == {"ckpt.bin": b.read_bytes()}, "the under-storage kept the first copy"
    n.stop()
    # the cache is lost: a fresh node on the same under-storage reads the second copy
    m = make_node(ufs=n.ufs)
    assert (m.mnt / "ckpt.bin").read_bytes() == b.read_bytes()


def test_reopen_overwrite_same_size_loop(make_node):
    """open, write, close, reopen, overwrite as many bytes, close, over a few files,
    with the first content landed before the reopen (written in place) or still pending
    (a new generation, or in place ahead of its PUT); most overwrites set the mtime back
    to what it was, as a timestamp-preserving copy does (on a coarse kernel clock the
    mtime does not move at all).  After each round, what landed is the last content."""
    n = make_node(flush_delay=0.05)
    names = [f"f{i}" for i in range(3)]
    last: dict[str, bytes] = {}
    for it in range(6):
        mtimes = {}
        for i, name in enumerate(names):
            fd = os.open(n.mnt / name, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, pattern(4096, seed=1000 * it + i), 0)
                mtimes[name] = os.fstat(fd).st_mtime_ns
            finally:
                os.close(fd)
        if it % 2 == 0:
            n.flush()
        for i, name in enumerate(names):
            data = pattern(4096, seed=1000 * it + i + 500)
            fd = os.open(n.mnt / name, os.O_RDWR)
            try:
                os.pwrite(fd, data, 0)
                if it % 3 != 2:
                    os.utime(fd, ns=(mtimes[name], mtimes[name]))
            finally:
                os.close(fd)
            last[name] = data
        n.flush()
        got = n.ufs_files()
        stale = sorted(k for k, v in last.items() if got.get(k) != v)
        assert not stale, f"round {it}: the under-storage kept old bytes of {stale}"
    n.stop()
    m = make_node(ufs=n.ufs)
    assert {k: (m.mnt / k).read_bytes() for k in names} == last


def test_write_open_without_write_keeps_content(make_node):
    """The cost side of the rule: a write open that writes nothing journals the file
    again, and what lands is still its content (not an empty or torn file)."""
    n = make_node()
    data = pattern(300_000, seed=7)
    (n.mnt / "x.bin").write_bytes(data)
    n.flush()
    for _ in range(3):
        os.close(os.open(n.mnt / "x.bin", os.O_RDWR))
    n.flush()
    assert n.ufs_files() == {"x.bin": data}


def test_mapping_written_after_close_and_landing_lands(make_node):
    """A shared mapping outlives close(2) of its descriptor (Python's mmap holds a dup):
    the close journals the file, its PUT lands, then the mapping rewrites the page it
    had dirtied before the close and is unmapped.  Under kernel passthrough such stores
    reach the cache file without the daemon and, on a page already dirty, without moving
    mtime: the last RELEASE must journal the file again."""
    n = make_node(flush_delay=0.05)
    p = n.mnt / "m.bin"
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, 8192)
    m = mmap.mmap(fd, 8192)
    try:
        m[:] = b"A" * 8192
        os.close(fd)      # FLUSH: journaled; the mapping (a dup of fd) stays
        deadline = time.monotonic() + 60
        while n.ufs_files().get("m.bin") != b"A" * 8192:
            assert time.monotonic() < deadline, "the close's PUT never landed"
            time.sleep(0.02)
        m[:] = b"B" * 8192
    finally:
        m.close()         # munmap and close(2) of the dup: FLUSH, RELEASE
    assert p.read_bytes() == b"B" * 8192
    n.flush()
    assert n.ufs_files() == {"m.bin": b"B" * 8192}, "the under-storage kept what the close saw"


def test_a_big_file_kept_open_in_place_says_what_persisting_waits_for(make_node):
    """A big closed file (over the cache's copy limit, no reflinks on ext4) reopened r+
    before its upload started is written in place, its PUT held for that writer's close
    (journal.hold_put): what was journaled after it waits too.  Status names the file, and
    a barrier on a later file that times out says why; the close lets everything land."""
    n = make_node(flush_delay=30)
    big = n.mnt / "big.npy"
    with open(big, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 80 << 20)
        f.write(b"v1")
    (n.mnt / "ckpt").write_bytes(b"step 1")
    g = open(big, "r+b")       # as np.load(mmap_mode="r+") or an appender keeps it
    try:
        g.write(b"v2")
        g.flush()
        # over the socket from here: the CLI's fork+exec would close (FLUSH) g
        w = n.status_here()["waits_for_writer"]
        assert w is not None and (w["path"], w["behind"]) == ("big.npy", 1), w
        from rich.console import Console

        from acache.cli import node_table
        from acache.errors import AcacheError
        from acache.node.client import Client
        con = Console(width=400, record=True)
        con.print(node_table(n.status_here()))
        assert "for big.npy's writer to close it" in con.export_text()
        with Client(n.home / "acache.sock", timeout=30) as c, \
                pytest.raises(AcacheError, match="behind the PUT of big.npy, which waits for its writer"):
            c.flush(str(n.mnt / "ckpt"), 0.5, None)
    finally:
        g.close()
    n.flush()
    got = n.ufs_files()
    assert got["ckpt"] == b"step 1" and got["big.npy"][:2] == b"v2"
    assert n.status_here()["waits_for_writer"] is None
