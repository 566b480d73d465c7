"""Two cluster nodes over RDMA, inside the rdma VM (scripts/test_rdma): a large file written
through one node's mount reads byte-identical through another's, its bytes moved by RDMA READ
(status shows rdma for that peer); then a node started with ``transport = tcp`` reads the same
bytes over TCP (status says why).  Nodes listen on the soft-RoCE device's address; etcd runs
on loopback in the VM.  Size: ACACHE_TEST_RDMA_CLUSTER_BIG, default 96 MiB (more than the
serving pool's 64 MiB, so slots are reused): under the VM's CPU emulation 1 GiB through two
FUSE mounts, RDMA and TCP took over 13 minutes, 256 MiB 7.7 minutes of a CI run whose budget
is 90; the transport's own test (tests/unit/test_rdma.py) reads 256 MiB over RDMA, more on
request."""
from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from acache.config import parse_size
from tests.cluster_hosts import write_secret
from tests.cluster_local import LocalCluster, free_port
from tests.e2e.conftest import _need_fuse

pytestmark = pytest.mark.rdma

HOST = os.environ.get("ACACHE_TEST_RDMA_HOST", "10.11.12.1")
BIG = parse_size(os.environ.get("ACACHE_TEST_RDMA_CLUSTER_BIG", "96MiB"))


def _write(path, size: int) -> str:
    """Every 4 KiB block starts with its offset, the rest random; returns the sha256."""
    h = hashlib.sha256()
    block = bytearray(os.urandom(1 << 20))
    with open(path, "wb") as f:
        for mib in range(0, size, 1 << 20):
            for off in range(0, 1 << 20, 4096):
                block[off:off + 8] = (mib + off).to_bytes(8, "little")
            piece = block[:min(1 << 20, size - mib)]
            f.write(piece)
            h.update(piece)
    return h.hexdigest()


def _sha(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _peer_path(node, peer: str) -> str:
    """What the node's status says of its connection to ``peer`` (asked over the control
    socket in this process: a CLI run costs ~20 s under the VM's emulation)."""
    from acache.node.client import Client
    with Client(node.home / "acache.sock", timeout=60) as c:
        st = c.call("status", path=None)
    return {n["id"]: n["transport"] for n in st["cluster"]["nodes"]}[peer]


@pytest.fixture(autouse=True)
def _slow_start(monkeypatch):
    from tests.acache_node import AcacheNode
    monkeypatch.setattr(AcacheNode, "start_timeout", 600.0)   # emulated CPU: starts take ~30-90 s


@pytest.mark.timeout(1200)
def test_two_nodes_read_over_rdma_then_tcp(tmp_path, etcd1):
    _need_fuse()
    secret = write_secret(tmp_path / "secret")
    extra = f'secret_file = "{secret}"\n'
    c = LocalCluster(tmp_path, etcd1, 2, engine="native", flush_delay=3600, extra=extra)
    for node in c.nodes:        # on the rxe device's address, not loopback
        cfg = (node.home / "config.toml").read_text().replace('listen = "127.0.0.1', f'listen = "{HOST}')
        (node.home / "config.toml").write_text(cfg)
    with c:
        a, b = c.nodes
        want = _write(a.mnt / "big", BIG)
        assert _sha(b.mnt / "big") == want
        assert _peer_path(b, "n1") == "rdma"
        # a third node with transport = tcp: negotiation picks TCP, same bytes
        b.stop()
        shutil.rmtree(b.home / "cache")    # the VM's RAM holds the cache files
        from tests.acache_node import AcacheNode
        cfg = (f'meta = "{c.url}"\nlisten = "{HOST}:{free_port()}"\nnode_id = "n3"\n{extra}'
               'transport = "tcp"\n')
        t = AcacheNode(tmp_path / "n3", engine="native", ufs=c.ufs, flush_delay=3600, config=cfg)
        t.start()
        try:
            assert _sha(t.mnt / "big") == want
            path = _peer_path(t, "n1")
            assert path.startswith("tcp") and path != "rdma", path
        finally:
            t.stop()
