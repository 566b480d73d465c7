"""fallocate(2) through the mount: allocation (with and without KEEP_SIZE), punching
holes and zeroing ranges land in the cache file like writes, and the persisted file
is what a local disk would hold.  pyfuse3 has no fallocate handler (libfuse answers
ENOSYS, after which the kernel refuses fallocate on the mount): there every mode is
EOPNOTSUPP, and posix_fallocate() still works (glibc then writes the zeros)."""
import ctypes
import errno
import os

import pytest

from tests.e2e.contract_util import pattern

KEEP_SIZE, PUNCH_HOLE, COLLAPSE_RANGE, ZERO_RANGE = 0x01, 0x02, 0x08, 0x10
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, mode, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _supported(variant: str) -> bool:
    return variant != "pyfuse3"


def test_posix_fallocate_then_write(make_variant_node):
    n = make_variant_node()
    p = n.mnt / "prealloc.bin"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.posix_fallocate(fd, 0, 1 << 20)
        assert os.fstat(fd).st_size == 1 << 20
        assert os.pread(fd, 8192, 0) == bytes(8192)
        data = pattern(100_000, seed=1)
        os.pwrite(fd, data, 4096)
        assert os.pread(fd, len(data), 4096) == data
    finally:
        os.close(fd)
    want = bytes(4096) + data + bytes((1 << 20) - 4096 - len(data))
    assert p.read_bytes() == want
    n.flush()
    assert n.ufs_files() == {"prealloc.bin": want}


def test_modes(make_variant_node, variant):
    n = make_variant_node()
    base = pattern(64 << 10, seed=2)
    (n.mnt / "keep.bin").write_bytes(base[:100])
    (n.mnt / "grow.bin").write_bytes(base[:100])
    (n.mnt / "punch.bin").write_bytes(base)
    (n.mnt / "zero.bin").write_bytes(base)
    want = {"keep.bin": base[:100], "grow.bin": base[:100], "punch.bin": base, "zero.bin": base}
    cases = [("keep.bin", KEEP_SIZE, 0, 1 << 20), ("grow.bin", 0, 0, 256 << 10),
             ("punch.bin", PUNCH_HOLE | KEEP_SIZE, 4096, 8192), ("zero.bin", ZERO_RANGE, 60 << 10, 8 << 10)]
    for name, mode, off, length in cases:
        fd = os.open(n.mnt / name, os.O_RDWR)
        try:
            if not _supported(variant):
                with pytest.raises(OSError) as ei:
                    fallocate(fd, mode, off, length)
                assert ei.value.errno == errno.EOPNOTSUPP, (name, ei.value)
                continue
            fallocate(fd, mode, off, length)
            with pytest.raises(OSError) as ei:      # not done anywhere: refused, file unchanged
                fallocate(fd, COLLAPSE_RANGE, 0, 4096)
            assert ei.value.errno == errno.EOPNOTSUPP
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        w = want[name]
        if mode == KEEP_SIZE:
            assert size == 100
        elif mode == 0:
            w = w + bytes((256 << 10) - len(w))
        elif mode & PUNCH_HOLE:
            w = w[:off] + bytes(length) + w[off + length:]
        else:       # zero range past the end, without KEEP_SIZE: the file grows
            w = w[:off] + bytes(off + length - len(w[:off]))
        assert size == len(w), name
        want[name] = w
        assert (n.mnt / name).read_bytes() == w, name
    n.flush()
    assert n.ufs_files() == want
    # and after a restart of the node
    n.cli("down")
    n.cli("up")
    n.cli("mount", str(n.mnt))
    for name, w in want.items():
        assert (n.mnt / name).read_bytes() == w, name


def test_allocation_counts_as_cache_use(make_variant_node, variant):
    """Allocated blocks fill the cache disk like written bytes: counted while the
    file is still open (the limit holds writers back by it), not only at its close."""
    n = make_variant_node()
    fd = os.open(n.mnt / "big.bin", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        before = n.status()["cache_used"]
        if _supported(variant):
            fallocate(fd, KEEP_SIZE, 0, 32 << 20)
            assert n.status()["cache_used"] >= before + (32 << 20)
        else:
            with pytest.raises(OSError) as ei:
                fallocate(fd, KEEP_SIZE, 0, 32 << 20)
            assert ei.value.errno == errno.EOPNOTSUPP
            assert n.status()["cache_used"] == before
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)
