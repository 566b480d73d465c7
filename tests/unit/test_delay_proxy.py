"""tests/delay_proxy.py, the far link of ``scripts/bench_cluster --s3-rtt``: every byte
arrives intact and a request/response round trip through it takes at least the round trip
it was given (a lower bound: the proxy waits, so this cannot pass by luck)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.s3server import free_port

REPO = Path(__file__).resolve().parents[2]


def _echo_server() -> tuple[socket.socket, int]:
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                while data := c.recv(1 << 16):
                    c.sendall(data)
    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def test_bytes_pass_intact_and_each_round_trip_takes_the_delay():
    srv, port = _echo_server()
    listen = free_port()
    p = subprocess.Popen([sys.executable, "-m", "tests.delay_proxy", f"127.0.0.1:{listen}",
                          f"127.0.0.1:{port}", "40"], cwd=REPO, stderr=subprocess.PIPE)
    try:
        assert b"delay proxy" in p.stderr.readline()          # listening from here on
        with socket.create_connection(("127.0.0.1", listen), timeout=10) as c:
            payload = os.urandom(3 << 20)
            t0 = time.monotonic()
            c.sendall(b"x")
            assert c.recv(1) == b"x"
            rtt = time.monotonic() - t0
            sender = threading.Thread(target=c.sendall, args=(payload,))
            sender.start()
            got = bytearray()
            while len(got) < len(payload):
                chunk = c.recv(1 << 20)
                assert chunk, "the proxy closed the stream early"
                got += chunk
            sender.join()
        assert rtt >= 0.080, rtt              # 40 ms each way
        assert bytes(got) == payload
    finally:
        p.kill()
        p.wait()
        srv.close()
