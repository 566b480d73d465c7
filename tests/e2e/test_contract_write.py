"""Contract, point 1 (and 2): the write path on a real mount, driven by ordinary programs.

Each test checks the bytes through the mount, then `flush --wait`, then the
under-storage byte for byte."""
from __future__ import annotations

import errno
import mmap
import os
import subprocess
import time


from tests.e2e.contract_util import pattern, ufs_real


def test_otrunc_over_dirty_and_persisted_file(make_node):
    n = make_node(flush_delay=30)          # "dirty": nothing persists until asked
    a = n.mnt / "a.pt"
    a.write_bytes(pattern(3 << 20, 1))
    assert os.getxattr(a, "user.acache.state") == b"dirty"
    with open(a, "wb") as f:               # O_TRUNC over the dirty file
        f.write(b"short")
    assert a.read_bytes() == b"short" and os.stat(a).st_size == 5
    n.flush()
    assert ufs_real(n.ufs_files()) == {"a.pt": b"short"}
    # again over the persisted file, by another program
    subprocess.run(["dd", "if=/dev/zero", f"of={a}", "bs=1000", "count=3", "status=none"],
                   check=True)
    assert a.read_bytes() == b"\0" * 3000
    n.flush()
    assert ufs_real(n.ufs_files()) == {"a.pt": b"\0" * 3000}
    # O_TRUNC then nothing written: an empty file
    os.close(os.open(a, os.O_WRONLY | os.O_TRUNC))
    assert a.read_bytes() == b""
    n.flush()
    assert ufs_real(n.ufs_files()) == {"a.pt": b""}


def test_otrunc_while_persisting(space):
    n = space
    a = n.mnt / "big.bin"
    for i in range(5):                      # overwrite while earlier versions upload
        a.write_bytes(pattern((8 << 20) - i * 1000, i))
    final = pattern(1234, 99)
    a.write_bytes(final)
    assert a.read_bytes() == final
    n.flush()
    assert ufs_real(n.ufs_files()) == {"big.bin": final}


SIZES = [64, 4096, 65537, (1 << 20) + 3, 32 << 20]


def test_sequential_writes(space):
    want = {}
    for size in SIZES:
        data = pattern(size, size)
        p = space.mnt / f"seq-{size}"
        with open(p, "wb") as f:               # writes of assorted sizes
            off, step = 0, 1
            while off < size:
                k = min(step, size - off)
                f.write(data[off:off + k])
                off += k
                step = step * 7 % 3_000_001 + 1
        assert os.stat(p).st_size == size
        assert p.read_bytes() == data
        cp = space.mnt / f"cp-{size}"
        subprocess.run(["cp", str(p), str(cp)], check=True)
        assert cp.read_bytes() == data
        want[f"seq-{size}"] = want[f"cp-{size}"] = data
    dd = space.mnt / "dd.bin"
    subprocess.run(["dd", f"if={space.mnt / 'cp-1048579'}", f"of={dd}", "bs=64k", "status=none"],
                   check=True)
    want["dd.bin"] = want["cp-1048579"]
    space.flush()
    assert ufs_real(space.ufs_files()) == want


def test_writes_at_earlier_offsets(space):
    size = 3 << 20
    model = bytearray(pattern(size, 3))
    p = space.mnt / "rw.bin"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, model)
    for off, n in [(0, 10), (100, 5000), (size - 7, 7), (1 << 20, 1 << 20), (4095, 2)]:
        chunk = pattern(n, off + 1000)
        assert os.pwrite(fd, chunk, off) == n
        model[off:off + n] = chunk
    os.lseek(fd, 12345, os.SEEK_SET)      # plain write after a seek back
    os.write(fd, b"XYZ")
    model[12345:12348] = b"XYZ"
    os.close(fd)
    # reopen without O_TRUNC and patch again (new generation of a closed file)
    with open(p, "r+b") as f:
        f.seek(2 << 20)
        f.write(b"patched")
    model[2 << 20:(2 << 20) + 7] = b"patched"
    assert p.read_bytes() == bytes(model)
    space.flush()
    assert ufs_real(space.ufs_files())["rw.bin"] == bytes(model)


def test_append(space):
    p = space.mnt / "log.txt"
    want = b""
    for i in range(20):
        line = f"line {i}\n".encode() * (i + 1)
        with open(p, "ab") as f:
            f.write(line)
        want += line
        if i == 10:
            space.flush()     # appending to an already persisted file
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    os.pwrite(fd, b"", 0)
    os.lseek(fd, 0, os.SEEK_SET)           # O_APPEND writes at the end whatever the offset
    os.write(fd, b"tail")
    os.close(fd)
    want += b"tail"
    subprocess.run(["sh", "-c", 'printf shell >> "$1"', "sh", p], check=True)
    want += b"shell"
    assert p.read_bytes() == want
    space.flush()
    assert ufs_real(space.ufs_files())["log.txt"] == want


def test_truncate_and_ftruncate(space):
    d = pattern(2 << 20, 5)
    p = space.mnt / "t.bin"
    p.write_bytes(d)
    os.truncate(p, 1000)                    # truncate(2) of a closed, dirty file
    assert os.stat(p).st_size == 1000 and p.read_bytes() == d[:1000]
    space.flush()
    os.truncate(p, 10)                      # of a persisted file
    assert p.read_bytes() == d[:10]
    os.truncate(p, 50)                      # extending: zeros
    assert p.read_bytes() == d[:10] + b"\0" * 40
    with open(p, "r+b") as f:               # ftruncate through the open file
        f.write(b"abc")
        f.truncate(2)
        assert os.fstat(f.fileno()).st_size == 2
        f.seek(0, os.SEEK_END)
        f.write(b"Z")
    assert p.read_bytes() == b"abZ"
    subprocess.run(["truncate", "-s", "6", str(p)], check=True)
    assert p.read_bytes() == b"abZ\0\0\0"
    space.flush()
    assert ufs_real(space.ufs_files()) == {"t.bin": b"abZ\0\0\0"}


def test_safetensors_ftruncate_then_write_inside(space):
    """safetensors: create, ftruncate to the final size, then write the pieces in place."""
    size = (5 << 20) + 321
    data = pattern(size, 6)
    p = space.mnt / "model.safetensors"
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, size)
    assert os.fstat(fd).st_size == size and os.stat(p).st_size == size
    pieces = list(range(0, size, 1 << 20))
    for off in reversed(pieces):            # not even in order
        os.pwrite(fd, data[off:off + (1 << 20)], off)
    # read back through the same descriptor, and through mmap before closing
    assert os.pread(fd, 100, size - 100) == data[-100:]
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        assert m[:] == data
    finally:
        m.close()
    os.close(fd)
    assert p.read_bytes() == data
    space.flush()
    assert ufs_real(space.ufs_files())["model.safetensors"] == data
    # and once more over the persisted file, with truncate to 0 then extend
    data2 = pattern(size - 5, 7)
    fd = os.open(p, os.O_RDWR)
    os.ftruncate(fd, 0)
    os.ftruncate(fd, len(data2))
    for off in pieces:
        os.pwrite(fd, data2[off:off + (1 << 20)], off)
    os.close(fd)
    assert p.read_bytes() == data2
    space.flush()
    assert ufs_real(space.ufs_files())["model.safetensors"] == data2


def test_ftruncate_extends_persisted_file(space):
    d = pattern(100_000, 8)
    p = space.mnt / "grow.bin"
    p.write_bytes(d)
    space.flush()
    with open(p, "r+b") as f:
        f.truncate(300_000)
    assert os.stat(p).st_size == 300_000
    assert p.read_bytes() == d + b"\0" * 200_000
    space.flush()
    assert ufs_real(space.ufs_files())["grow.bin"] == d + b"\0" * 200_000


def test_fsync_durable_on_cache_tier_not_ufs(make_node):
    """fsync returns without the under-storage (flush_delay huge) and survives kill -9,
    with the file still open; closed files survive too."""
    n = make_node(flush_delay=3600)
    files = {f"shard{i}.pt": pattern((1 << 20) * (i + 1) + i, 10 + i) for i in range(4)}
    fds = []
    for name, data in files.items():
        fd = os.open(n.mnt / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, data)
        t0 = time.monotonic()
        os.fsync(fd)
        assert time.monotonic() - t0 < 5
        if name.startswith("shard0"):
            os.close(fd)
        else:
            fds.append(fd)       # fsynced, still open at the crash
    os.fdatasync(fds[0])
    assert ufs_real(n.ufs_files()) == {}, "fsync must not wait for (or trigger) the upload"
    n.kill9()
    for fd in fds:
        try:
            os.close(fd)
        except OSError as e:
            assert e.errno in (errno.ENOTCONN, errno.EIO, errno.ECONNABORTED), e
    n.restart()
    for name, data in files.items():
        assert (n.mnt / name).read_bytes() == data
    n.flush()
    assert ufs_real(n.ufs_files()) == files
