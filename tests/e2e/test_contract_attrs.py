"""Contract, point 1 (attributes and friends) and 7 (the state xattr): racing
mkdir, mmap of a closed fd, st_size while dirty, mode/uid/gid, mtimes, xattrs, statfs."""
from __future__ import annotations

import errno
import mmap
import multiprocessing
import os
import stat
import time

import pytest

from tests.e2e.contract_util import pattern, ufs_real


def _race(path: str, idx: int, barrier, out) -> None:
    barrier.wait()
    try:
        os.mkdir(path)
        res = 0
    except OSError as e:
        res = e.errno
    try:   # then every process creates its own file in it, at once
        barrier.wait()
        with open(os.path.join(path, f"rank{idx}.pt"), "wb") as f:
            f.write(pattern(64_000 + idx, idx))
        out.put((idx, res, 0))
    except OSError as e:
        out.put((idx, res, e.errno))


def test_racing_mkdir_and_creates(space):
    ctx = multiprocessing.get_context("fork")
    nproc = 12
    for round_ in range(4):
        d = str(space.mnt / f"ckpt-{round_}")
        barrier = ctx.Barrier(nproc)
        q = ctx.Queue()
        procs = [ctx.Process(target=_race, args=(d, i, barrier, q)) for i in range(nproc)]
        for p in procs:
            p.start()
        res = [q.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        mk = sorted(r[1] for r in res)
        assert mk.count(0) == 1, f"round {round_}: mkdir results {[errno.errorcode.get(e, e) for e in mk]}"
        assert all(e == errno.EEXIST for e in mk if e), mk
        assert all(r[2] == 0 for r in res), res
        assert sorted(os.listdir(d)) == sorted(f"rank{i}.pt" for i in range(nproc))
    space.flush()
    ufs = ufs_real(space.ufs_files())
    assert len(ufs) == 4 * nproc
    assert ufs["ckpt-3/rank5.pt"] == pattern(64_005, 5)


def test_mmap_private_after_close(space):
    data = pattern((3 << 20) + 17, 4)
    p = space.mnt / "model.safetensors"
    p.write_bytes(data)
    for persisted in (False, True):
        if persisted:
            space.flush()
        fd = os.open(p, os.O_RDONLY)
        m = mmap.mmap(fd, 0, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)            # safetensors closes the file right after mapping it
        try:
            assert len(m) == len(data)
            assert m[:] == data
            m[0:4] = b"priv"    # a private copy: never reaches the file
        finally:
            m.close()
    assert p.read_bytes() == data


def test_exact_size_while_dirty(make_node):
    n = make_node(flush_delay=30)
    p = n.mnt / "growing.bin"
    total = 0
    with open(p, "wb") as f:
        for k in (1, 511, 4096, 100_000, 1 << 20, 3):
            f.write(b"x" * k)
            f.flush()
            total += k
            assert os.stat(p).st_size == total            # another lookup, same process
            assert os.fstat(f.fileno()).st_size == total
    assert os.stat(p).st_size == total
    assert os.getxattr(p, "user.acache.state") == b"dirty"
    with open(p, "r+b") as f:
        f.seek(total + 1000)
        f.write(b"y")
    assert os.stat(p).st_size == total + 1001
    n.flush()
    assert os.stat(p).st_size == total + 1001


def test_mode_uid_gid_chmod_utime(space):
    p = space.mnt / "secret.safetensors"
    old = os.umask(0o022)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    finally:
        os.umask(old)
    os.write(fd, b"x")
    os.close(fd)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    os.chmod(p, 0o640)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640
    os.chown(p, 1234, 5678)
    s = os.stat(p)
    assert (s.st_uid, s.st_gid) == (1234, 5678)
    os.chown(p, -1, 42)
    assert (os.stat(p).st_uid, os.stat(p).st_gid) == (1234, 42)
    os.utime(p, ns=(1_000_000_000_123, 2_000_000_000_456))
    s = os.stat(p)
    assert s.st_atime_ns == 1_000_000_000_123 and s.st_mtime_ns == 2_000_000_000_456
    d = space.mnt / "d"
    os.mkdir(d, 0o700)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    os.chmod(d, 0o751)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o751
    space.flush()              # persisting changes nothing of it
    s = os.stat(p)
    assert stat.S_IMODE(s.st_mode) == 0o640 and (s.st_uid, s.st_gid) == (1234, 42)
    assert s.st_mtime_ns == 2_000_000_000_456
    # utime while open for writing, then close: the explicit time is kept? no -- the
    # close after a write moves it; a utime after the last write wins
    with open(p, "r+b") as f:
        f.write(b"y")
    os.utime(p, ns=(5_000_000_000, 6_000_000_000))
    assert os.stat(p).st_mtime_ns == 6_000_000_000


def test_mtime_advances_file_and_directory(space):
    d = space.mnt / "ckpts"
    d.mkdir()
    stamps = []
    for i in range(3):
        before = os.stat(d).st_mtime_ns
        time.sleep(0.02)
        (d / f"checkpoint-{i}").mkdir()
        after = os.stat(d).st_mtime_ns
        assert after > before, "directory mtime must advance when an entry is added"
        stamps.append(os.stat(d / f"checkpoint-{i}").st_mtime_ns)
    assert stamps == sorted(stamps) and len(set(stamps)) == 3
    # HF rotation: sorted by mtime == creation order
    names = sorted(os.listdir(d), key=lambda x: os.stat(d / x).st_mtime_ns)
    assert names == [f"checkpoint-{i}" for i in range(3)]
    f = d / "f"
    f.write_bytes(b"1")
    m1 = os.stat(f).st_mtime_ns
    before = os.stat(d).st_mtime_ns
    time.sleep(0.02)
    with open(f, "ab") as fh:
        fh.write(b"2")
    assert os.stat(f).st_mtime_ns > m1
    os.utime(f, ns=(0, 0))
    t0 = time.time_ns()
    os.utime(f)                          # UTIME_NOW, as `touch f` does
    assert abs(os.stat(f).st_mtime_ns - t0) < 5_000_000_000
    time.sleep(0.02)
    os.unlink(f)
    assert os.stat(d).st_mtime_ns > before, "directory mtime must advance on unlink"


def test_getxattr_unknown_is_enodata_fast(space):
    p = space.mnt / "f"
    p.write_bytes(b"x")
    for target in (p, space.mnt):
        for name in ("security.capability", "system.posix_acl_access", "user.foo",
                     "trusted.x", "user.acache.other"):
            for _ in range(20):
                with pytest.raises(OSError) as ei:
                    os.getxattr(target, name)
                assert ei.value.errno == errno.ENODATA, (target, name, ei.value)
    assert os.listxattr(p) == [], "the computed state xattr must not be listed (cp -a copies it)"
    assert os.getxattr(p, "user.acache.state") in (b"dirty", b"persisting", b"persisted")
    with pytest.raises(OSError):
        os.setxattr(p, "user.acache.state", b"persisted")


def test_state_xattr_dirty_to_persisted(make_node):
    n = make_node(flush_delay=30)
    p = n.mnt / "shard.pt"
    with open(p, "wb") as f:
        f.write(b"data")
        assert os.getxattr(p, "user.acache.state") == b"dirty"     # open for writing
    assert os.getxattr(p, "user.acache.state") == b"dirty"         # closed, not persisted
    st = n.status(str(n.mnt))
    assert [(f["path"], f["state"], f["size"]) for f in st["files"]] == [("shard.pt", "dirty", 4)]
    n.flush()
    assert os.getxattr(p, "user.acache.state") == b"persisted"
    st = n.status(str(n.mnt))
    assert [(f["path"], f["state"]) for f in st["files"]] == [("shard.pt", "persisted")]
    with open(p, "ab") as f:
        f.write(b"more")
    assert os.getxattr(p, "user.acache.state") == b"dirty"
    n.flush()
    assert os.getxattr(p, "user.acache.state") == b"persisted"
    # renamed: the under-storage does not hold it at its new name until the rename lands
    os.rename(p, n.mnt / "renamed.pt")
    assert os.getxattr(n.mnt / "renamed.pt", "user.acache.state") != b"persisted"
    (n.mnt / "dir").mkdir()
    n.flush()
    os.rename(n.mnt / "renamed.pt", n.mnt / "dir" / "x.pt")
    os.rename(n.mnt / "dir", n.mnt / "dir2")
    assert os.getxattr(n.mnt / "dir2" / "x.pt", "user.acache.state") != b"persisted"
    assert os.getxattr(n.mnt / "dir2", "user.acache.state") != b"persisted"
    n.flush()
    assert os.getxattr(n.mnt / "dir2" / "x.pt", "user.acache.state") == b"persisted"
    assert os.getxattr(n.mnt / "dir2", "user.acache.state") == b"persisted"


def test_statfs_reports_the_cache(make_node):
    n = make_node(extra_env={"ACACHE_CACHE_SIZE": "1GiB"})
    s = os.statvfs(n.mnt)
    assert s.f_blocks * s.f_frsize == 1 << 30
    assert s.f_bavail <= s.f_blocks and s.f_bfree <= s.f_blocks
    free0 = s.f_bavail * s.f_frsize
    (n.mnt / "big").write_bytes(pattern(64 << 20, 1))
    free1 = os.statvfs(n.mnt).f_bavail * os.statvfs(n.mnt).f_frsize
    assert free0 - free1 >= 60 << 20, (free0, free1)
    assert n.status()["cache_limit"] == 1 << 30


def _as_user(uid: int, gid: int):
    def drop():
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    return drop


def test_files_belong_to_their_creator(space):
    import subprocess
    d = space.mnt / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    subprocess.run(["/bin/sh", "-c", "echo u > f && mkdir sub && (umask 077 && : > private)"],
                   cwd=d, check=True, preexec_fn=_as_user(4321, 8765))
    for name in ("f", "sub", "private"):
        s = os.stat(d / name)
        assert (s.st_uid, s.st_gid) == (4321, 8765), name
    assert stat.S_IMODE(os.stat(d / "private").st_mode) == 0o600
    (space.mnt / "root-only").write_bytes(b"r")
    os.chmod(space.mnt / "root-only", 0o600)
    p = subprocess.run(["/bin/cat", str(space.mnt / "root-only")], capture_output=True, text=True,
                       preexec_fn=_as_user(4321, 8765))
    assert p.returncode != 0 and "Permission denied" in p.stderr, p.stderr
