"""upload_limit: the persister's uploads together stay within the limit (file:// copies,
S3 parts and puts), writers are not slowed by it, and `acache status` shows it."""
from __future__ import annotations

import os
import time

import pytest

from tests.acache_node import AcacheNode
from tests.e2e.conftest import _need_fuse
from tests.s3server import S3Server

MiB = 1 << 20
LIMIT = 6 * MiB
BURST = 1 * MiB             # acache.data.limit: max(1 MiB, rate / 4)
DATA = 24 * MiB             # 4 s at the limit


def _write(mnt, n_files: int, size: int) -> float:
    t0 = time.monotonic()
    for i in range(n_files):
        with open(mnt / f"f{i}", "wb") as f:
            f.write(os.urandom(size))
    return time.monotonic() - t0


def _check(rate_bytes: int, seconds: float, what: str) -> None:
    rate = rate_bytes / seconds
    assert rate_bytes <= LIMIT * 1.1 * seconds + BURST, \
        f"{what}: {rate / MiB:.2f} MiB/s over {seconds:.1f} s, limit {LIMIT / MiB:.0f} MiB/s"
    assert rate >= LIMIT * 0.7, f"{what}: {rate / MiB:.2f} MiB/s, far below the limit"


@pytest.mark.parametrize("engine", ["native"])
def test_limit_file_ufs(tmp_path, engine):
    _need_fuse()
    n = AcacheNode(tmp_path, engine=engine, flush_delay=0,
                   extra_env={"ACACHE_UPLOAD_LIMIT": f"{LIMIT}"}).start()
    try:
        st = n.status()
        assert st["upload_limit"] == "6 MiB/s", st["upload_limit"]
        wrote = _write(n.mnt, 6, DATA // 6)
        t0 = time.monotonic()
        # writers are not held back: 24 MiB took far less than the 4 s the uploads need
        assert wrote < DATA / LIMIT / 2, f"writing took {wrote:.2f} s"
        n.flush()
        took = time.monotonic() - t0 + wrote
        _check(DATA, took, "file://")
        assert len(n.ufs_files()) == 6
    finally:
        n.stop()


def test_limit_s3_parts_and_puts(tmp_path):
    _need_fuse()
    with S3Server() as srv:
        env = {f"ACACHE_S3_{k.upper()}": str(v) for k, v in
               srv.options(part_size=5 * MiB, multipart_threshold=5 * MiB).items()}
        env["ACACHE_UPLOAD_LIMIT"] = f"{LIMIT // MiB}MiB/s"
        n = AcacheNode(tmp_path, engine="native", ufs=srv.url("lim"), flush_delay=0,
                       extra_env=env).start()
        try:
            up0 = srv.bytes_up
            # 2 multipart files (3 parts each) and 6 small PutObjects of 1 MiB
            _write(n.mnt, 2, 9 * MiB)
            for i in range(6):
                (n.mnt / f"small{i}").write_bytes(os.urandom(MiB))
            t0 = time.monotonic()
            seen: list[tuple[float, int]] = []
            # the flush in the background, the server's byte meter sampled meanwhile
            import subprocess
            import sys
            p = subprocess.Popen([sys.executable, "-m", "acache.cli", "flush", "--wait",
                                  "--timeout", "120"], env=n.env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
            while p.poll() is None:
                seen.append((time.monotonic() - t0, srv.bytes_up - up0))
                time.sleep(0.2)
            assert p.returncode == 0, p.stderr
            took = time.monotonic() - t0
            total = srv.bytes_up - up0
            assert total >= 24 * MiB
            _check(total, took, "s3")
            # and within any window of 2 s or more, not only on average
            for i, (ta, ba) in enumerate(seen):
                for tb, bb in seen[i + 1:]:
                    if tb - ta >= 2.0:
                        assert bb - ba <= LIMIT * 1.1 * (tb - ta) + BURST + 5 * MiB, \
                            (ta, tb, (bb - ba) / MiB)
            assert len(srv.objects("lim")) == 8
        finally:
            n.stop()


def test_limit_bad_values_are_one_line(tmp_path):
    for value, words in (("fast", "not a rate"), ("0", "above 0"),
                         ("08:00,1MiB/s 07:00,off", "increase"), ("25:00,off", "time of day")):
        n = AcacheNode(tmp_path / value.replace("/", "_").replace(" ", "_"),
                       extra_env={"ACACHE_UPLOAD_LIMIT": value})
        p = n.cli("up", check=False)
        lines = p.stderr.strip().splitlines()
        assert p.returncode != 0 and len(lines) == 1, p.stderr
        assert "upload_limit" in lines[0] and "ACACHE_UPLOAD_LIMIT" in lines[0] \
            and words in lines[0], lines[0]
        assert "Traceback" not in p.stderr
