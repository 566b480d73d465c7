"""Contract, point 1: files already in the under-storage are visible and readable
through the mount, fetched in large chunks (never one request per small read)."""
from __future__ import annotations

import hashlib
import os
import random
import stat
import subprocess

from tests.e2e.contract_util import pattern, ufs_real


def _prepopulate(n) -> dict[str, bytes]:
    files = {
        "top.txt": b"hello\n",
        "empty": b"",
        "ckpt/step-10/.metadata": pattern(1000, 1),
        "ckpt/step-10/__0_0.distcp": pattern((9 << 20) + 5, 2),   # more than one chunk
        "ckpt/step-10/sub/deep.bin": pattern(70_000, 3),
        "ckpt/latest": b"10",
    }
    for k, v in files.items():
        (n.ufs_dir / k).parent.mkdir(parents=True, exist_ok=True)
        (n.ufs_dir / k).write_bytes(v)
    (n.ufs_dir / "emptydir").mkdir()
    return files


def test_readthrough_visible_and_identical(make_node):
    n = make_node(start=False)
    files = _prepopulate(n)
    (n.ufs_dir / "unread").mkdir()
    (n.ufs_dir / "unread" / "a").write_bytes(pattern(50_000, 11))
    (n.ufs_dir / "unread" / "b").write_bytes(pattern(50_000, 12))
    n.start()
    assert sorted(os.listdir(n.mnt)) == ["ckpt", "empty", "emptydir", "top.txt", "unread"]
    assert sorted(os.listdir(n.mnt / "ckpt" / "step-10")) == [".metadata", "__0_0.distcp", "sub"]
    assert stat.S_ISDIR(os.stat(n.mnt / "emptydir").st_mode)
    for k, v in files.items():
        assert os.stat(n.mnt / k).st_size == len(v), k
        assert (n.mnt / k).read_bytes() == v, k
    # another program, and a second read from the cache
    out = subprocess.run(["sha256sum", str(n.mnt / "ckpt/step-10/__0_0.distcp")],
                         capture_output=True, text=True, check=True).stdout.split()[0]
    assert out == hashlib.sha256(files["ckpt/step-10/__0_0.distcp"]).hexdigest()
    assert os.getxattr(n.mnt / "top.txt", "user.acache.state") == b"persisted"
    # modifying a read-through file: the rest of it is kept
    with open(n.mnt / "ckpt/step-10/sub/deep.bin", "r+b") as f:
        f.seek(100)
        f.write(b"PATCH")
    want = bytearray(files["ckpt/step-10/sub/deep.bin"])
    want[100:105] = b"PATCH"
    # appending to one never fetched before
    with open(n.mnt / "ckpt/latest", "ab") as f:
        f.write(b"0")
    # O_TRUNC over one, truncate(2) of another: neither was read before
    with open(n.mnt / "unread" / "a", "wb") as f:
        f.write(b"bye")
    os.truncate(n.mnt / "unread" / "b", 10)
    assert (n.mnt / "unread" / "b").read_bytes() == pattern(50_000, 12)[:10]
    n.flush()
    ufs = ufs_real(n.ufs_files())
    assert ufs["ckpt/step-10/sub/deep.bin"] == bytes(want)
    assert ufs["ckpt/latest"] == b"100"
    assert ufs["unread/a"] == b"bye"
    assert ufs["unread/b"] == pattern(50_000, 12)[:10]
    assert ufs["ckpt/step-10/__0_0.distcp"] == files["ckpt/step-10/__0_0.distcp"]


def test_readthrough_rename_and_delete_of_ufs_files(make_node):
    n = make_node(start=False)
    files = _prepopulate(n)
    n.start()
    os.rename(n.mnt / "ckpt" / "step-10", n.mnt / "ckpt" / "step-10-old")
    os.unlink(n.mnt / "top.txt")
    n.flush()
    ufs = ufs_real(n.ufs_files())
    assert "top.txt" not in ufs
    assert ufs["ckpt/step-10-old/__0_0.distcp"] == files["ckpt/step-10/__0_0.distcp"]
    assert not any(k.startswith("ckpt/step-10/") for k in ufs)


def test_dcp_like_random_reads_few_ufs_requests(make_node):
    size = 64 << 20
    n = make_node(start=False)
    data = pattern(size, 7)
    (n.ufs_dir / "ckpt").mkdir(parents=True)
    (n.ufs_dir / "ckpt" / "__0_0.distcp").write_bytes(data)
    n.start()
    before = n.status()["ufs_reads"]
    rng = random.Random(1)
    with open(n.mnt / "ckpt" / "__0_0.distcp", "rb", buffering=0) as f:
        for _ in range(1000):
            off = rng.randrange(0, size - 4096)
            f.seek(off)
            assert f.read(4096) == data[off:off + 4096]
    reads = n.status()["ufs_reads"] - before
    chunks = size // (8 << 20)
    assert 1 <= reads <= chunks + 4, f"{reads} under-storage reads for 1000 small reads"
    # the whole file is cached now: a full read costs nothing more
    assert (n.mnt / "ckpt" / "__0_0.distcp").read_bytes() == data
    assert n.status()["ufs_reads"] - before == reads


def test_unlinked_while_open_reads_whole_after_the_delete_lands(make_node):
    """POSIX: an open file stays readable after unlink.  A file only in the under-storage,
    opened and barely read, unlinked, the delete persisted (`flush --wait`): the rest of
    it still reads back exactly through the open descriptor."""
    n = make_node(start=False, flush_delay=0.05)
    data = pattern((20 << 20) + 11, 21)              # several chunks, none fetched yet
    n.ufs_dir.mkdir(parents=True, exist_ok=True)
    (n.ufs_dir / "big").write_bytes(data)
    n.start()
    fd = os.open(n.mnt / "big", os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == data[:4096]
        os.unlink(n.mnt / "big")
        n.flush()
        assert not (n.ufs_dir / "big").exists()      # the delete landed
        got = b"".join(os.pread(fd, 1 << 20, off) for off in range(0, len(data), 1 << 20))
        assert got == data
    finally:
        os.close(fd)
