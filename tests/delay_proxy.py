"""A TCP proxy that delays every byte by a fixed time in each direction: a far link for a
benchmark where the kernel has no netem (``CONFIG_NET_SCH_NETEM`` is off on this machine).

    python -m tests.delay_proxy LISTEN_ADDR:PORT TARGET_ADDR:PORT ONE_WAY_MS

Each connection is forwarded to the target; what one side sends reaches the other side
ONE_WAY_MS later, so a request/response round trip takes 2 x ONE_WAY_MS more, and a stream
keeps its bandwidth (bytes are buffered, not paced).  What it does not model: the TCP
handshake and TCP's window over the far link (the proxy acknowledges at once), so a
connection's first bytes and a window-limited stream are faster than over a real link
of that round trip.  For a client with a pool of kept-alive connections (minio, the
benchmark's uploaders) the difference is the first request of each pooled connection.
"""
from __future__ import annotations

import queue
import socket
import sys
import threading
import time

CHUNK = 256 << 10


def _pump(src: socket.socket, dst: socket.socket, delay: float, done: threading.Event) -> None:
    q: queue.SimpleQueue[tuple[float, bytes] | None] = queue.SimpleQueue()

    def later() -> None:
        try:
            while (item := q.get()) is not None:
                due, data = item
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)       # the link's propagation delay, by construction
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            done.set()

    t = threading.Thread(target=later, daemon=True)
    t.start()
    try:
        while data := src.recv(CHUNK):
            q.put((time.monotonic() + delay, data))
    except OSError:
        pass
    q.put(None)


def _serve(conn: socket.socket, target: tuple[str, int], delay: float) -> None:
    try:
        up = socket.create_connection(target, timeout=30)
    except OSError:
        conn.close()
        return
    up.settimeout(None)
    for s in (conn, up):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    a, b = threading.Event(), threading.Event()
    threading.Thread(target=_pump, args=(up, conn, delay, b), daemon=True).start()
    _pump(conn, up, delay, a)
    a.wait()
    b.wait()
    conn.close()
    up.close()


def _addr(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    return host, int(port)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    listen, target, delay = _addr(argv[0]), _addr(argv[1]), float(argv[2]) / 1000
    srv = socket.create_server(listen, backlog=256)
    print(f"delay proxy {argv[0]} -> {argv[1]}, {argv[2]} ms each way", file=sys.stderr, flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_serve, args=(conn, target, delay), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
