"""The TCP client's control stream: a small request is never queued behind bulk requests.

A cacheless client's next open (and every namespace call to a head that is also a busy
worker) used to wait behind megabytes of writes in the socket buffers of every stream of the
pool -- seconds on a saturated link.  Here the server stops reading the bulk streams (each
runs its one allowed request, which is held), so anything sent behind them waits until they
are released: a small request must be answered while they are still held."""
from __future__ import annotations

import threading

from acache.net import wire
from acache.net.tcp import CONTROL_PAYLOAD, TcpTransport
from acache.net.transport import Reply

SECRET = b"the-cluster-secret-0123456789abcdef"
OPTS = dict(timeout=5.0, connect_timeout=2.0, handshake_timeout=2.0, frame_timeout=2.0,
            limits=wire.Limits(max_meta=64 << 10, max_payload=16 << 20), payload_budget=64 << 20)


def test_small_requests_pass_held_bulk_streams():
    held = threading.Event()
    entered = threading.Semaphore(0)
    # max_inflight=1: a connection whose one request is held is not read any further
    lst = TcpTransport(SECRET, **OPTS, workers=8, max_inflight=1).listen("127.0.0.1:0")

    def hold(meta, payload):
        entered.release()
        held.wait(30)
        return Reply({"n": len(payload)}, b"")
    lst.register("hold", hold)
    lst.register("echo", lambda meta, p: Reply(meta, bytes(p)))
    lst.start()
    conn = TcpTransport(SECRET, **OPTS, streams=2).connect(lst.address)
    bulk = bytes(CONTROL_PAYLOAD + 1)
    out: list = []
    ts = [threading.Thread(target=lambda: out.append(conn.request("hold", {}, bulk, timeout=60)))
          for _ in range(3)]
    try:
        for t in ts:
            t.start()
        assert entered.acquire(timeout=10), "no bulk request reached the server"
        # every bulk stream the pool may open now carries a held request (or sits behind one)
        for _ in range(2):
            entered.acquire(timeout=0.5)
        got = conn.request("echo", {"small": 1}, b"x" * 100)
        assert got == ({"small": 1}, b"x" * 100)
        assert not held.is_set() and len(out) == 0        # answered while the bulk was held
        assert conn.stats()["streams"] == 2               # the control stream + one bulk
    finally:
        held.set()
        for t in ts:
            t.join(30)
        conn.close()
        lst.close()
    assert out == [({"n": len(bulk)}, b"")] * 3


def test_one_stream_pool_has_no_control_lane():
    """``streams = 1`` is a single connection: everything shares it (as configured)."""
    lst = TcpTransport(SECRET, **OPTS).listen("127.0.0.1:0")
    lst.register("echo", lambda meta, p: Reply(meta, bytes(p)))
    lst.start()
    conn = TcpTransport(SECRET, **OPTS, streams=1).connect(lst.address)
    try:
        assert conn.request("echo", {}, bytes(CONTROL_PAYLOAD + 1))[1] == bytes(CONTROL_PAYLOAD + 1)
        assert conn.request("echo", {"a": 1})[0] == {"a": 1}
        assert conn.stats()["streams"] == 1 and conn.stats()["streams_opened"] == 1
    finally:
        conn.close()
        lst.close()
