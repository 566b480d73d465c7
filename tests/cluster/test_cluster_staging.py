"""The head stages a member's files with no copy of their bytes on the head
(acache.cluster.member _Head.stage_elsewhere): over a real S3 server (moto) the member (the
file's holder) uploads the multipart parts from its own cache while the head creates,
records and completes the upload in order; over a shared directory the member writes the
stage's temp file and the head renames it into place in order.  A holder killed mid-upload
resumes after its restart with nothing lost and no upload left behind."""
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


def test_a_members_files_go_up_from_the_member_shared_dir(tmp_path, etcd1):
    """file:// (a directory every node mounts, as NFS): the member writes the temp file."""
    with LocalCluster(tmp_path, etcd1, 2, flush_delay=0.2) as c:
        head_id = c.wait_head()
        head, member = c.node(head_id), c.nodes[1 if head_id == "n1" else 0]
        files = {"d/big.bin": os.urandom(9 * MiB + 17), "d/small.bin": os.urandom(1000),
                 "d/empty": b""}
        (member.mnt / "d").mkdir()
        for k, v in files.items():
            (member.mnt / k).write_bytes(v)
        os.chmod(member.mnt / "d/small.bin", 0o640)
        member.flush(timeout=120)
        assert c.ufs_files() == files
        assert not list(c.ufs_dir.rglob(".acache-tmp.*"))
        assert (c.ufs_dir / "d/small.bin").stat().st_mode & 0o777 == 0o640
        # the head never held a copy of the member's files
        sizes = _cache_sizes(head)
        assert len(files["d/big.bin"]) not in sizes and 1000 not in sizes, sizes
        assert (head.mnt / "d/big.bin").read_bytes() == files["d/big.bin"]


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


def test_a_dead_holders_persisted_file_reads_from_the_under_storage(tmp_path, etcd1):
    """The head keeps no copy of a member's file: once persisted, a reader elsewhere whose
    holder is dead reads it from the under-storage, not EIO (a file not yet persisted still
    fails with EIO: test_cluster_hosts' kill -9 test)."""
    with LocalCluster(tmp_path, etcd1, 2, flush_delay=0.2) as c:
        head_id = c.wait_head()
        head, member = c.node(head_id), c.nodes[1 if head_id == "n1" else 0]
        landed = os.urandom(3 * MiB + 5)
        (member.mnt / "landed.bin").write_bytes(landed)
        member.flush(timeout=120)
        assert c.ufs_files() == {"landed.bin": landed}
        assert len(landed) not in _cache_sizes(head)
        member.kill9()
        assert (head.mnt / "landed.bin").read_bytes() == landed
        assert "reading it from the under-storage" in head.log_tail()
