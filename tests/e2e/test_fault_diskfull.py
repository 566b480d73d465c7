"""Fault: the cache filesystem fills up while S3 is down (issue 9, item 1).

The cache directory sits on a 200 MiB tmpfs made by the test, with cache_size = 100MiB and
the metadata (RocksDB) on the same filesystem, as by default.  With S3 stopped: a 30 MiB
file is written and closed, then `dd` writes 400 MiB (more than the cache and the
filesystem hold): it must end in ENOSPC (backpressure, then stall_timeout; or the
filesystem's own ENOSPC for a file already open with passthrough) without breaking the
metadata.  Then mkdir/rm either work and persist, or fail with an errno and are applied
nowhere; `flush --wait` is truthful throughout; the node stops with `down --no-flush`,
starts again (after SIGTERM on pyfuse3), and once S3 is back every closed file is
byte-identical in S3.

Runs on the native engine with kernel passthrough, without it, and on pyfuse3.
"""
from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import time
import uuid

import pytest

from tests.acache_node import AcacheNode, errno_of as _try, fuse_mounts, mount_tmpfs, umount_tmpfs
from tests.s3server import S3Server

pytestmark = [pytest.mark.e2e, pytest.mark.s3]
MiB = 1 << 20
VARIANTS = {"native-passthrough": ("native", "1"), "native-no-passthrough": ("native", "0"),
            "pyfuse3": ("pyfuse3", "1")}


@pytest.fixture
def small_fs(tmp_path):
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.fail("e2e tests need /dev/fuse and root")
    d = mount_tmpfs(tmp_path / "cachefs")
    yield d
    umount_tmpfs(d)


def _bucket(srv: S3Server, prefix: str) -> dict[str, bytes]:
    """Every object under prefix/ (directory markers included, as b'')."""
    return srv.objects(prefix, markers=True)


def _status(n: AcacheNode) -> dict:
    """`status`, asked in this process: a CLI child would close (FLUSH) our open files."""
    from acache.node.client import Client
    with Client(n.home / "acache.sock", timeout=30) as c:
        return c.call("status")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cache_fs_full_with_s3_down_loses_nothing(variant, small_fs, tmp_path):
    engine, passthrough = VARIANTS[variant]
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    with S3Server() as srv:
        env = {f"ACACHE_S3_{k.upper()}": str(v) for k, v in srv.options().items()}
        env.update(ACACHE_CACHE_DIR=str(small_fs / "cache"), ACACHE_CACHE_SIZE="100MiB",
                   ACACHE_STALL_TIMEOUT="4", ACACHE_PASSTHROUGH=passthrough)
        n = AcacheNode(tmp_path / "n", engine=engine, ufs=srv.url(prefix), extra_env=env)
        n.start()
        try:
            st = n.status()
            assert st["engine"] == engine
            assert st["passthrough"] == (variant == "native-passthrough"), st
            (n.mnt / "keep").write_bytes(b"persisted before the outage")
            (n.mnt / "victim").write_bytes(b"removed during the outage")
            n.flush()
            srv.stop()

            a = random.Random(1).randbytes(30 * MiB)
            with open(n.mnt / "a.bin", "wb") as f:       # closed, rc 0
                f.write(a)
            dd = subprocess.run(["dd", "if=/dev/urandom", f"of={n.mnt / 'big'}", "bs=1M",
                                 "count=400"], capture_output=True, text=True, timeout=300)
            assert dd.returncode != 0 and "No space left on device" in dd.stderr, dd.stderr
            big = (n.mnt / "big").read_bytes()           # what dd's writes left, closed
            assert len(big) >= MiB

            st = n.status()                              # truthful: both files dirty, counted
            assert st["dirty_files"] == 2, st
            assert st["cache_used"] >= len(a) + len(big), st
            assert st["queue"] >= 2, st
            p = n.cli("flush", "--wait", "--timeout", "2", check=False)
            assert p.returncode != 0, "flush --wait returned 0 while S3 was down"
            t0 = time.monotonic()                    # new files wait for room, then ENOSPC
            assert _try(lambda: (n.mnt / "late").write_bytes(b"late")) == errno.ENOSPC
            assert time.monotonic() - t0 >= 3.5 and not (n.mnt / "late").exists()

            # namespace changes: either they work (and persist), or they fail with an errno
            # and are applied nowhere
            mkdir_err = _try(lambda: (n.mnt / "d1").mkdir())
            rm_err = _try(lambda: (n.mnt / "victim").unlink())
            assert mkdir_err in (0, errno.EIO, errno.ENOSPC), os.strerror(mkdir_err)
            assert rm_err in (0, errno.EIO, errno.ENOSPC), os.strerror(rm_err)
            assert (n.mnt / "d1").is_dir() == (mkdir_err == 0)
            assert (n.mnt / "victim").exists() == (rm_err != 0)

            # stop without flushing while S3 is down and the cache is full (`down --no-flush`,
            # or SIGTERM on one engine); start again
            if engine == "pyfuse3":
                pid = n.pid()
                os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + 60
                while os.path.exists(f"/proc/{pid}"):
                    assert time.monotonic() < deadline, "SIGTERM did not stop the node"
                    time.sleep(0.1)
            else:
                down = n.cli("down", "--no-flush", check=False, timeout=120)
                assert down.returncode == 0, down.stderr + n.log_tail()
            assert n.pid() is None
            assert str(n.mnt) not in fuse_mounts()
            n.restart()
            assert n.status()["dirty_files"] == 2
            p = n.cli("flush", "--wait", "--timeout", "2", check=False)
            assert p.returncode != 0, "flush --wait returned 0 while S3 was down"

            srv.start()
            n.flush(timeout=180)
            want = {"keep": b"persisted before the outage", "a.bin": a, "big": big}
            if rm_err:
                want["victim"] = b"removed during the outage"
            if not mkdir_err:
                want["d1/"] = b""
            got = _bucket(srv, prefix)
            assert sorted(got) == sorted(want)
            for k in want:
                assert got[k] == want[k], f"{k}: {len(got[k])} bytes in S3, {len(want[k])} closed"
            assert (n.mnt / "a.bin").read_bytes() == a
            assert (n.mnt / "big").read_bytes() == big
            st = n.status()
            assert st["dirty_files"] == 0 and st["queue"] == 0 and st["dirty_bytes"] == 0, st
            n.cli("down", timeout=120)
            assert n.pid() is None
        finally:
            n.stop()


def test_passthrough_writes_are_counted_and_held_back_near_the_limit(tmp_path):
    """With kernel passthrough the daemon never sees the writes: the size of a file open
    for writing is still counted while it grows, and near the limit a new write open is
    served by the daemon, so that its writes wait for room (ENOSPC after stall_timeout)."""
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.fail("e2e tests need /dev/fuse and root")
    stall = 3.0
    with S3Server() as srv:
        env = {f"ACACHE_S3_{k.upper()}": str(v) for k, v in srv.options().items()}
        env.update(ACACHE_CACHE_SIZE="32MiB", ACACHE_STALL_TIMEOUT=str(stall))
        n = AcacheNode(tmp_path / "n", engine="native", ufs=srv.url(f"t-{uuid.uuid4().hex[:8]}"),
                       extra_env=env)
        n.start()
        try:
            assert n.status()["passthrough"]
            (n.mnt / "listed").write_bytes(b"")      # the root is listed while S3 is up
            srv.stop()                               # nothing can be persisted
            grown = random.Random(2).randbytes(20 * MiB)
            with open(n.mnt / "grown", "wb") as f:   # passed through: an empty cache
                f.write(grown)
                f.flush()
                deadline = time.monotonic() + 10
                while _status(n)["cache_used"] < len(grown):
                    assert time.monotonic() < deadline, \
                        f"a file growing under passthrough is not counted: {_status(n)}"
                    time.sleep(0.1)
            (n.mnt / "more").write_bytes(random.Random(3).randbytes(10 * MiB))
            # 30 of 32 MiB used: this open is not passed through, its writes wait, then fail
            fd = os.open(n.mnt / "late", os.O_CREAT | os.O_WRONLY, 0o644)
            err, t0 = None, time.monotonic()
            try:
                for _ in range(8):
                    os.write(fd, b"x" * MiB)
            except OSError as e:
                err = e
            finally:
                os.close(fd)
            assert err is not None and err.errno == errno.ENOSPC, \
                "writes near the limit were not held back (passed through?)"
            assert time.monotonic() - t0 >= stall - 0.5
            srv.start()
            n.flush(timeout=120)
        finally:
            n.stop()


def test_a_write_open_near_the_limit_never_writes_into_a_readers_generation(tmp_path):
    """Near the limit a write open is served by the daemon, but the kernel passes every open
    of an inode with a backing file through to that file: a writer rewriting a file that a
    reader holds open (passed through to the old generation) must wait for the reader, then
    get EBUSY -- never write into the old generation's file (the reader would see the new
    bytes, and the new generation would stay empty)."""
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.fail("e2e tests need /dev/fuse and root")
    with S3Server() as srv:
        env = {f"ACACHE_S3_{k.upper()}": str(v) for k, v in srv.options().items()}
        env.update(ACACHE_CACHE_SIZE="32MiB", ACACHE_STALL_TIMEOUT="3")
        n = AcacheNode(tmp_path / "n", engine="native", ufs=srv.url(f"t-{uuid.uuid4().hex[:8]}"),
                       extra_env=env)
        n.start()
        try:
            assert n.status()["passthrough"]
            old = random.Random(4).randbytes(MiB)
            (n.mnt / "a").write_bytes(old)
            srv.stop()                               # nothing is persisted, nothing evicted
            reader = os.open(n.mnt / "a", os.O_RDONLY)   # passed through to generation 1
            try:
                (n.mnt / "more").write_bytes(random.Random(5).randbytes(28 * MiB))
                # 29 of 32 MiB used: a new write open is not passed through
                err = 0
                try:
                    fd = os.open(n.mnt / "a", os.O_WRONLY | os.O_TRUNC)
                except OSError as e:
                    err = e.errno
                else:
                    try:
                        os.write(fd, b"N" * 4096)
                    finally:
                        os.close(fd)
                assert os.pread(reader, len(old), 0) == old, \
                    "the reader's generation changed under it"
                assert err == errno.EBUSY, \
                    "the writer did not wait for the reader" if err == 0 else os.strerror(err)
            finally:
                os.close(reader)
            # refused before anything changed: the O_TRUNC did not empty the file
            assert (n.mnt / "a").read_bytes() == old
            with open(n.mnt / "a", "r+b") as f:      # the reader gone, a writer may open
                f.write(b"N" * 4096)
            assert (n.mnt / "a").read_bytes() == b"N" * 4096 + old[4096:]
            srv.start()
            n.flush(timeout=120)
        finally:
            n.stop()
