"""The TCP transport over a real link: two network namespaces joined by a veth pair, the peer
server (python -m tests.net_peer) in one, the client in the other.  Needs root (skipped with
the reason otherwise; a failure under ACACHE_TEST_REQUIRE_ALL=1, see tests/conftest.py)."""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import time

import pytest

from acache.net.remote_file import RemoteFile
from acache.net.tcp import TcpTransport
from acache.net.transport import PeerUnavailable
from tests.netns import VethPair

TIMEOUT = 2.0      # the client's timeout: a dead link fails a read within 2x this (+1 s slack)
SIZE = 64 << 20

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                                reason="needs root and iproute2 (ip netns, veth, tc)")


@pytest.fixture
def link(tmp_path):
    root = tmp_path / "files"
    root.mkdir()
    data = os.urandom(SIZE)
    (root / "f").write_bytes(data)
    secret = tmp_path / "secret"
    secret.write_bytes(b"link-test-secret-0123456789abcdef")
    os.chmod(secret, 0o600)
    with VethPair() as pair:
        _, addr = pair.spawn("a", [sys.executable, "-m", "tests.net_peer", f"{pair.ip_a}:0",
                                   str(root), str(secret)])
        yield pair, addr, hashlib.sha256(data).hexdigest(), secret
    # VethPair.__exit__ killed the server and deleted both namespaces


def test_read_over_veth_and_a_link_that_goes_down(link):
    pair, addr, want, secret = link
    from acache.net.auth import load_secret
    t = TcpTransport(load_secret(secret), timeout=TIMEOUT, connect_timeout=TIMEOUT)
    got_4mib, down, failed, up = (threading.Event() for _ in range(4))
    down_at: list[float] = []

    def client() -> dict:
        conn = t.connect(addr)
        res: dict = {"caps": conn.peer_capabilities, "error": None}
        buf = bytearray(SIZE)
        assert conn.read_into("read", {"name": "f", "offset": 0, "length": SIZE}, memoryview(buf)) == SIZE
        res["first"] = hashlib.sha256(buf).hexdigest()
        # a sequential reader; the link goes down under it after its first 4 MiB
        rf = RemoteFile(conn, "read", {"name": "f"}, SIZE, chunk=1 << 20, parallel=2, readahead=2)
        off = 0
        try:
            while off < SIZE:
                off += len(rf.pread(off, 1 << 20))
                if off == 4 << 20:
                    got_4mib.set()
                    assert down.wait(30)
        except PeerUnavailable as e:
            res["error"], res["after"] = e, time.monotonic() - down_at[0]
        finally:
            failed.set()
        res["read_before_failing"] = off
        rf.close()
        assert up.wait(60)
        buf[:] = bytes(SIZE)
        assert conn.read_into("read", {"name": "f", "offset": 0, "length": SIZE}, memoryview(buf)) == SIZE
        res["again"] = hashlib.sha256(buf).hexdigest()
        res["streams_opened"] = conn.stats()["streams_opened"]
        conn.close()
        return res

    # 400 Mbit on the server's side, so that the link is the bottleneck: ~1.3 s per 64 MiB
    pair.tc("a", "qdisc", "add", "dev", pair.dev_a, "root", "tbf", "rate", "400mbit", "burst", "256kb",
            "latency", "50ms")
    out: dict = {}
    th = threading.Thread(target=lambda: out.update(r=pair.run_in("b", client, timeout=120)))
    th.start()
    try:
        assert got_4mib.wait(60), "the reader never got its first 4 MiB"
        pair.ip("b", "link", "set", pair.dev_b, "down")
        down_at.append(time.monotonic())
        down.set()
        assert failed.wait(2 * TIMEOUT + 10), "the read did not fail with the link down"
    finally:
        pair.ip("b", "link", "set", pair.dev_b, "up")
        up.set()
        down.set()
        th.join(120)
    r = out["r"]
    print(f"link down -> {type(r['error']).__name__} after {r.get('after', -1):.2f}s "
          f"(bound {2 * TIMEOUT + 1.0}s): {r['error']}")
    assert r["caps"]["transport"] == "tcp" and r["first"] == want
    assert isinstance(r["error"], PeerUnavailable) and r["error"].retryable, r
    assert r["after"] <= 2 * TIMEOUT + 1.0, r["after"]
    assert 4 << 20 <= r["read_before_failing"] < SIZE
    assert r["again"] == want and r["streams_opened"] >= 2
