"""A cluster over a real S3 server (moto): a big file closed on a member is staged by the
head with no copy of its bytes on the head -- the member (its holder) uploads the multipart
parts from its own cache, the head creates, records and completes the upload in order
(acache.cluster.member _Head._stage_elsewhere); a holder killed mid-upload resumes after
its restart with nothing lost and no upload left behind."""
from __future__ import annotations

import os
import time
import uuid

import pytest

from tests.cluster_local import LocalCluster
from tests.e2e.conftest import _need_fuse
from tests.s3server import S3Server

pytestmark = pytest.mark.usefixtures("need_fuse")
MiB = 1 << 20


@pytest.fixture
def need_fuse():
    _need_fuse()


@pytest.fixture(scope="module")
def srv():
    with S3Server() as s:
        yield s


def _cluster(tmp_path, etcd1, srv, **kw) -> tuple[LocalCluster, str]:
    prefix = f"c-{uuid.uuid4().hex[:10]}"
    env = {f"ACACHE_S3_{k.upper()}": str(v)
           for k, v in srv.options(part_size="5MiB", multipart_threshold="5MiB").items()}
    return LocalCluster(tmp_path, etcd1, 2, ufs=srv.url(prefix), extra_env=env, **kw), prefix


def _cache_sizes(node) -> list[int]:
    root = node.home / "cache"
    return [p.stat().st_size for p in root.rglob("*") if p.is_file() and "meta" not in p.parts]


def _uploads(srv, prefix) -> list[str]:
    """The multipart uploads still open under the prefix (moto's ListMultipartUploads)."""
    c = srv.client()
    res = c._list_multipart_uploads(srv.bucket, prefix=prefix + "/")   # minio's own call
    return [u.object_name for u in res.uploads]


def test_a_members_big_file_goes_up_from_the_member(tmp_path, etcd1, srv):
    c, prefix = _cluster(tmp_path, etcd1, srv, flush_delay=0.2)
    with c:
        head_id = c.wait_head()
        head, member = c.node(head_id), c.nodes[1 if head_id == "n1" else 0]
        big, small = os.urandom(23 * MiB + 4321), os.urandom(100_000)
        (member.mnt / "d").mkdir()
        (member.mnt / "d" / "big.bin").write_bytes(big)
        (member.mnt / "d" / "small.bin").write_bytes(small)     # pulled: one PutObject
        before = srv.bytes_up
        member.flush(timeout=120)
        assert srv.objects(prefix) == {"d/big.bin": big, "d/small.bin": small}
        assert srv.bytes_up - before >= len(big) + len(small)
        # the parts came from the member: the head's cache never held the big file
        assert len(big) not in _cache_sizes(head), _cache_sizes(head)
        assert len(big) in _cache_sizes(member)
        parts = [r for r in srv.requests() if r[0] == "PUT" and r[1] == f"{prefix}/d/big.bin"
                 and "partNumber" in r[2]]
        assert len(parts) == 5 and all(r[3] == 200 for r in parts), parts
        assert _uploads(srv, prefix) == []
        # read back on the head (now from the under-storage or the member), byte-identical
        assert (head.mnt / "d" / "big.bin").read_bytes() == big


def test_holder_killed_mid_upload_lands_after_restart(tmp_path, etcd1, srv):
    c, prefix = _cluster(tmp_path, etcd1, srv, flush_delay=0.1)
    with c:
        head_id = c.wait_head()
        head, member = c.node(head_id), c.nodes[1 if head_id == "n1" else 0]
        big = os.urandom(40 * MiB)
        srv.throttle = 8 * MiB               # 5 s of upload: the kill lands mid-way
        try:
            (member.mnt / "big.bin").write_bytes(big)
            key = f"{prefix}/big.bin"
            deadline = time.monotonic() + 60
            while not any(r[0] == "PUT" and r[1] == key and "partNumber" in r[2]
                          for r in srv.requests()):
                assert time.monotonic() < deadline, member.log_tail()
                time.sleep(0.05)
            member.kill9()
            r = head.cli("flush", "--wait", "--timeout", "2", check=False, timeout=60)
            assert r.returncode != 0
            assert "big.bin" not in srv.objects(prefix)
        finally:
            srv.throttle = None
        member.restart()
        head.flush(timeout=120)
        assert srv.objects(prefix) == {"big.bin": big}
        assert _uploads(srv, prefix) == [], "an aborted stage left its multipart upload"
        assert (member.mnt / "big.bin").read_bytes() == big
