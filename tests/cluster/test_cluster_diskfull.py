"""Backpressure and the full-disk rules of one host, on cluster nodes whose writers the kernel
passes through (the native engine, issue 27).

Each node's cache is on a tmpfs of its own made by the test (200 MiB, as
tests/e2e/test_fault_diskfull.py) with a smaller cache_size; the under-storage is a real S3
server (moto).

  * S3 down, a member's cache fills: a closed file stays readable and is persisted once S3 is
    back; `dd` past the limit ends in ENOSPC, never a lost or torn closed file; a new file
    waits for room (stall_timeout) and fails with ENOSPC; `flush --wait` is truthful.
  * S3 up, a long flush delay: a writer that fills its node's cache waits for room, and the
    head persists without waiting for the flush delay (as one host does), so the writes go on
    -- on the head and on a member, whose persisting is done by the head.
"""
from __future__ import annotations

import errno
import os
import random
import subprocess
import time
import uuid

import pytest

from tests.acache_node import errno_of as _try, mount_tmpfs, umount_tmpfs
from tests.cluster_local import LocalCluster
from tests.e2e.conftest import _NATIVE, _need_fuse
from tests.s3server import S3Server

pytestmark = [pytest.mark.usefixtures("need_fuse"), pytest.mark.s3,
              pytest.mark.skipif(not _NATIVE, reason="the native engine cannot mount here")]
MiB = 1 << 20


@pytest.fixture
def need_fuse():
    _need_fuse()


@pytest.fixture
def tmpfs(tmp_path):
    made = []

    def make(name: str) -> str:
        made.append(mount_tmpfs(tmp_path / name))
        return str(made[-1] / "cache")
    yield make
    for d in made:
        umount_tmpfs(d)


def _cluster(tmp_path, etcd1, srv, tmpfs, prefix: str, **env) -> LocalCluster:
    delay = float(env.pop("flush_delay", 0.2))
    s3 = {f"ACACHE_S3_{k.upper()}": str(v) for k, v in srv.options().items()}
    c = LocalCluster(tmp_path / "c", etcd1, 2, engine="native", ufs=srv.url(prefix),
                     extra_env={**s3, **env}, flush_delay=delay)
    for i, n in enumerate(c.nodes):
        n.env["ACACHE_CACHE_DIR"] = tmpfs(f"cachefs{i}")
    return c


def test_a_members_cache_fills_while_s3_is_down(tmp_path, etcd1, tmpfs):
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    with S3Server() as srv, _cluster(tmp_path, etcd1, srv, tmpfs, prefix, ACACHE_CACHE_SIZE="100MiB",
                                     ACACHE_STALL_TIMEOUT="4") as c:
        head = c.node(c.wait_head())
        m = next(n for n in c.nodes if n is not head)
        st = m.status()
        assert st["passthrough"] is True and st["cache_limit"] == 100 * MiB, st
        (m.mnt / "keep").write_bytes(b"persisted before the outage")
        m.flush()
        srv.stop()

        a = random.Random(1).randbytes(30 * MiB)
        with open(m.mnt / "a.bin", "wb") as f:           # closed, rc 0
            f.write(a)
        dd = subprocess.run(["dd", "if=/dev/urandom", f"of={m.mnt / 'big'}", "bs=1M", "count=400"],
                            capture_output=True, text=True, timeout=300)
        assert dd.returncode != 0 and "No space left on device" in dd.stderr, dd.stderr
        big = (m.mnt / "big").read_bytes()               # what dd's writes left, closed
        assert len(big) >= MiB
        assert (head.mnt / "big").read_bytes() == big    # close-to-open on the head
        p = m.cli("flush", "--wait", "--timeout", "2", check=False)
        assert p.returncode != 0, "flush --wait returned 0 while S3 was down"
        t0 = time.monotonic()                            # a new file waits for room, then ENOSPC
        err = _try(lambda: (m.mnt / "late").write_bytes(b"late" * 1024))
        assert err == errno.ENOSPC, os.strerror(err) if err else "the write went through"
        assert time.monotonic() - t0 >= 3.5
        st = m.status()
        assert st["cache_used"] >= len(a) + len(big), st
        assert (m.mnt / "a.bin").read_bytes() == a       # nothing closed was lost meanwhile

        srv.start()
        m.flush(timeout=180)
        got = srv.objects(prefix)
        want = {"keep": b"persisted before the outage", "a.bin": a, "big": big}
        late = got.pop("late", None)                     # created, its write refused: empty
        assert late in (None, b""), len(late or b"")
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k] == want[k], f"{k}: {len(got[k])} bytes in S3, {len(want[k])} closed"
        # room again: the cache evicts what is persisted, and a new file is written
        (m.mnt / "after").write_bytes(b"room again")
        m.flush(timeout=60)
        assert srv.objects(prefix)["after"] == b"room again"


@pytest.mark.parametrize("where", ["head", "member"])
def test_a_full_cache_is_persisted_without_the_flush_delay(tmp_path, etcd1, tmpfs, where):
    """flush_delay = 1 h and a 32 MiB cache: four 12 MiB files in a row fill it; the fourth
    waits for room, which comes only if the head persists the first ones now (stall_timeout
    60 s: without that, ENOSPC after a minute)."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    with S3Server() as srv, _cluster(tmp_path, etcd1, srv, tmpfs, prefix, ACACHE_CACHE_SIZE="32MiB",
                                     ACACHE_STALL_TIMEOUT="60", flush_delay=3600) as c:
        head = c.node(c.wait_head())
        n = head if where == "head" else next(x for x in c.nodes if x is not head)
        files = {f"f{i}": random.Random(i).randbytes(12 * MiB) for i in range(4)}
        for name, data in files.items():
            err = _try(lambda: (n.mnt / name).write_bytes(data))
            assert err == 0, f"{name}: {os.strerror(err)} (the cache was not persisted to make room)"
        assert len(srv.objects(prefix)) >= 1, "nothing was persisted before the flush delay"
        n.flush(timeout=120)
        got = srv.objects(prefix)
        assert sorted(got) == sorted(files)
        for k, v in files.items():
            assert got[k] == v, k
        other = c.nodes[1] if n is c.nodes[0] else c.nodes[0]
        assert (other.mnt / "f0").read_bytes() == files["f0"]
