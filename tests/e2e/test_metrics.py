"""The node's Prometheus endpoint, scraped with prometheus-client's own parser during a
checkpoint: dirty data rises, falls to 0 after `acache flush --wait`; persisted bytes
rise; FUSE request counts and their histogram rise."""
from __future__ import annotations

import os
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.acache_node import AcacheNode
from tests.e2e.conftest import ENGINES, _need_fuse, engine_fixture

engine = engine_fixture(ENGINES)
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name.startswith("acache_"), fam.name
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def fuse_total(m: dict) -> float:
    return sum(v for (name, _), v in m.items() if name == "acache_fuse_requests_total")


def op_count(m: dict, op: str) -> float:
    return m.get(("acache_fuse_requests_total", (("op", op),)), 0)


@pytest.fixture
def metrics_node(tmp_path, engine):
    _need_fuse()
    port = free_port()
    # a long flush delay: what is written stays dirty until the barrier hurries it
    n = AcacheNode(tmp_path, engine=engine, flush_delay=3600,
                   extra_env={"ACACHE_METRICS": f"127.0.0.1:{port}"}).start()
    n.port = port
    yield n
    n.stop()


def test_metrics_follow_a_checkpoint(metrics_node):
    n = metrics_node
    m0 = scrape(n.port)
    for name in ("acache_dirty_bytes", "acache_persisted_bytes_total", "acache_cache_limit_bytes",
                 "acache_persist_queue_entries", "acache_writer_stall_seconds_total",
                 "acache_upload_limit_bytes_per_second"):
        assert (name, ()) in m0, f"{name} missing"
    assert m0[("acache_dirty_bytes", ())] == 0
    assert ("acache_upload_errors_total", (("kind", "transient"),)) in m0
    info = [k for k in m0 if k[0] == "acache_node_info"]
    assert info and dict(info[0][1])["engine"] == n.engine

    ck = n.mnt / "step-100"
    ck.mkdir()
    shards = 4
    for i in range(shards):
        with open(ck / f"shard-{i}.distcp", "wb") as f:
            f.write(os.urandom(4 * MiB))
            os.fsync(f.fileno())
    (ck / ".metadata").write_bytes(b"meta")
    total = shards * 4 * MiB + 4

    m1 = scrape(n.port)
    assert m1[("acache_dirty_bytes", ())] >= total, m1[("acache_dirty_bytes", ())]
    assert m1[("acache_dirty_files", ())] >= shards + 1
    assert m1[("acache_persist_queue_entries", ())] >= shards + 1
    assert m1[("acache_persist_queue_bytes", ())] >= total
    assert m1[("acache_persist_queue_oldest_age_seconds", ())] >= 0
    assert m1[("acache_persisted_bytes_total", ())] == m0[("acache_persisted_bytes_total", ())]
    assert fuse_total(m1) > fuse_total(m0)
    assert op_count(m1, "create") >= op_count(m0, "create") + shards + 1
    # the histogram of an op counts each request once
    assert m1[("acache_fuse_request_duration_seconds_count", (("op", "create"),))] == op_count(m1, "create")
    assert m1[("acache_fuse_request_duration_seconds_bucket", (("le", "+Inf"), ("op", "create")))] \
        == op_count(m1, "create")
    assert m1[("acache_fuse_request_duration_seconds_sum", (("op", "create"),))] > 0

    n.flush(str(n.mnt))
    m2 = scrape(n.port)
    assert m2[("acache_dirty_bytes", ())] == 0
    assert m2[("acache_dirty_files", ())] == 0
    assert m2[("acache_persist_queue_entries", ())] == 0
    assert m2[("acache_persisting_files", ())] == 0
    assert m2[("acache_persisted_bytes_total", ())] >= m1[("acache_persisted_bytes_total", ())] + total
    assert m2[("acache_persisted_files_total", ())] >= shards + 1
    assert m2[("acache_upload_bytes_total", ())] >= total
    assert m2[("acache_cache_used_bytes", ())] >= total    # clean now, still cached

    # reading back: served from the cache, more FUSE requests (with passthrough the kernel
    # reads the cache file itself, but the opens still come to the daemon)
    assert (ck / "shard-0.distcp").stat().st_size == 4 * MiB
    with open(ck / "shard-1.distcp", "rb") as f:
        assert len(f.read()) == 4 * MiB
    m3 = scrape(n.port)
    assert op_count(m3, "open") > op_count(m2, "open")
    assert m3[("acache_ufs_reads_total", ())] == m2[("acache_ufs_reads_total", ())]


def test_metrics_bad_address_is_one_line(tmp_path):
    n = AcacheNode(tmp_path, extra_env={"ACACHE_METRICS": "localhost:99999"})
    p = n.cli("up", check=False)
    assert p.returncode != 0
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "metrics" in err[0] and "99999" in err[0] \
        and "ACACHE_METRICS" in err[0], p.stderr
    assert "Traceback" not in p.stderr


def test_metrics_port_in_use_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        n = AcacheNode(tmp_path, extra_env={"ACACHE_METRICS": f"127.0.0.1:{port}"})
        p = n.cli("up", check=False)
        try:
            assert p.returncode != 0
            err = p.stderr.strip().splitlines()
            assert len(err) == 1 and "cannot listen" in err[-1] and str(port) in err[-1], p.stderr
            assert n.pid() is None, "the node must not stay up without its metrics endpoint"
        finally:
            n.stop()
