"""The control socket's bounds, with a small fake node (the real node: tests/e2e/test_control.py)."""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import msgpack
import pytest

from acache.errors import AcacheError
from acache.net import frame
from acache.node.client import Client
from acache.node.server import ControlServer


class FakeNode:
    mountpoint = "/mnt/x"

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self.release = threading.Event()
        self.flushing = threading.Event()

    def status(self, path=None) -> dict:
        return {"path": path, "ok": True}

    def flush(self, path, timeout, progress=None) -> dict:
        self.flushing.set()
        while not self.release.wait(0.01):
            progress({"bytes_left": 1})
        return {"ok": True, "seconds": 0.0}


@pytest.fixture
def server(tmp_path):
    made = []

    def make(**kw) -> tuple[ControlServer, str]:
        path = str(tmp_path / f"s{len(made)}.sock")
        srv = ControlServer(FakeNode(), path, **kw)
        t = threading.Thread(target=srv.serve, daemon=True)
        t.start()
        made.append((srv, t))
        return srv, path
    yield make
    for srv, t in made:
        srv.node.release.set()
        srv.stop()
        t.join(10)
        assert not t.is_alive()


def connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)          # blocking: waits while the accept backlog is full
    s.settimeout(30)
    return s


def raw_request(path: str, payload: bytes) -> dict | None:
    """Send bytes as they are; the reply frame (None if the server just closed)."""
    with connect(path) as s:
        s.sendall(payload)
        try:
            return frame.recv(s)
        except ConnectionError:
            return None


def status(path: str) -> dict:
    with Client(path, timeout=30) as c:
        return c.call("status", path="/p")


def wait_for(cond, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_idle_connections_take_no_thread_and_the_node_still_answers(server):
    srv, path = server(max_waiting=64)
    assert status(path)["ok"]
    before = threading.active_count()
    idle = [connect(path) for _ in range(300)]          # more than max_waiting, none sends
    try:
        idle[-1].sendall(b"\x00\x00")                    # and one sends half a header
        assert status(path) == {"path": "/p", "ok": True}
        assert threading.active_count() <= before + 1    # + the request thread just served
        wait_for(lambda: len(srv._waiting) <= 64, "the oldest idle connections to be closed")
        assert idle[0].recv(1) == b""                    # the oldest was closed to make room
    finally:
        for s in idle:
            s.close()


def test_incomplete_request_times_out(server):
    _, path = server(request_timeout=0.3)
    with connect(path) as s:
        s.sendall(struct.pack(">I", 100) + b"abc")       # 3 of 100 bytes, then nothing
        assert s.recv(1) == b""                          # closed by the server (within 30 s)
    assert status(path)["ok"]


def test_oversized_header_is_refused_before_the_body(server):
    _, path = server()
    with connect(path) as s:
        s.sendall(struct.pack(">I", 60 << 20))           # announces 60 MiB, sends none of it
        rep = frame.recv(s)                              # answered without waiting for the body
        assert "too large" in rep["error"] and rep["kind"] == "AcacheError"
        assert s.recv(1) == b""
    assert status(path)["ok"]


@pytest.mark.parametrize("body", [
    b"\xc1garbage",                                      # 0xc1 is never valid msgpack
    msgpack.packb([1, 2, 3]),                            # not a map
    msgpack.packb("status"),
    msgpack.packb({"op": 5}),                            # op not a string
    msgpack.packb({"op": "status", "path": 7}),          # a path that is not a string
    msgpack.packb({"op": "flush", "timeout": -3}),
    msgpack.packb({"op": "flush", "timeout": float("nan")}),
    msgpack.packb({"op": "mount"}),                      # no path
    msgpack.packb({"op": "status"}) + b"\xff\xff",       # length covers trailing garbage
])
def test_malformed_requests_get_an_error_and_one_log_line(server, caplog, body):
    _, path = server()
    caplog.set_level(logging.DEBUG, logger="acache")
    rep = raw_request(path, struct.pack(">I", len(body)) + body)
    assert rep is not None and "error" in rep, rep
    assert status(path)["ok"]                            # and the node keeps serving
    assert not any(r.exc_info for r in caplog.records), "a traceback in the log"
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) <= 1


def test_busy_beyond_max_clients_but_ping_still_answered(server):
    srv, path = server(max_clients=2)
    holders = []
    for _ in range(2):
        c = Client(path, timeout=30)
        threading.Thread(target=lambda c=c: c.flush(None, None), daemon=True).start()
        holders.append(c)
    try:
        wait_for(lambda: srv.active == 2, "two flushes in progress")
        with pytest.raises(AcacheError, match="busy"):
            status(path)
        with Client(path) as c:                          # liveness never refused
            assert c.call("ping")["mountpoint"] == "/mnt/x"
        before = threading.active_count()
        for _ in range(20):
            with pytest.raises(AcacheError, match="busy"):
                status(path)
        assert threading.active_count() <= before
    finally:
        srv.node.release.set()
        wait_for(lambda: srv.active == 0, "the flushes to end")
        for c in holders:
            c.sock.close()
    assert status(path)["ok"]


def test_client_gone_during_flush_is_one_line(server, caplog):
    srv, path = server()
    caplog.set_level(logging.DEBUG, logger="acache")
    s = connect(path)
    frame.send(s, {"op": "flush", "path": None, "timeout": None})
    wait_for(srv.node.flushing.is_set, "the flush to start")
    s.close()                                            # gone: progress frames fail
    wait_for(lambda: srv.active == 0, "the request to end")
    assert [r.getMessage() for r in caplog.records if "went away" in r.getMessage()]
    assert not any(r.exc_info for r in caplog.records)
    assert status(path)["ok"]
