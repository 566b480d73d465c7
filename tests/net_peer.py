"""Handlers for transport tests and scripts/bench_net, and a peer server to run elsewhere
(another network namespace):

    python -m tests.net_peer LISTEN ROOT [SECRET_FILE]      # prints "READY host:port"

ops: ``echo`` (meta and payload back), ``stat`` {name} -> {size}, ``read`` {name, offset,
length} -> the file's bytes as a FileRegion (sendfile), ``fail`` {errno} -> that errno.
``python -m tests.net_peer --plain LISTEN ROOT NAME`` serves the plain-copy baseline of the
bench instead: per connection, read an 8-byte length, sendfile that many bytes of NAME.
"""
from __future__ import annotations

import errno
import os
import socket
import struct
import sys
import threading

from acache.net.transport import FileRegion, Listener, Reply


class FileServer:
    """Serves the files of one directory by name (no '/'), each fd opened once."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _fd(self, name: object) -> int:
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise OSError(errno.EINVAL, "bad name")
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                fd = self._fds[name] = os.open(os.path.join(self.root, name), os.O_RDONLY | os.O_CLOEXEC)
            return fd

    def stat(self, meta: dict, payload: memoryview) -> dict:
        return {"size": os.fstat(self._fd(meta.get("name"))).st_size}

    def read(self, meta: dict, payload: memoryview) -> Reply:
        fd = self._fd(meta.get("name"))
        off, n = meta.get("offset"), meta.get("length")
        if not isinstance(off, int) or not isinstance(n, int) or off < 0 or n < 0:
            raise OSError(errno.EINVAL, "bad offset/length")
        size = os.fstat(fd).st_size
        return Reply({}, FileRegion(fd, off, max(0, min(n, size - off))))

    def register(self, listener: Listener) -> None:
        listener.register("echo", echo, inline=True)
        listener.register("fail", fail)
        listener.register("stat", self.stat, inline=True)
        listener.register("read", self.read, inline=True)   # the page cache (tmpfs in the bench)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def echo(meta: dict, payload: memoryview) -> Reply:
    return Reply(meta, bytes(payload))


def fail(meta: dict, payload: memoryview) -> dict:
    err = meta.get("errno")
    raise OSError(err if isinstance(err, int) else errno.EIO, "asked to fail")


def plain_serve(listen: str, path: str) -> None:
    """The bench baseline: a bare socket, sendfile of the requested byte count."""
    host, port = listen.rsplit(":", 1)
    srv = socket.create_server((host, int(port)), backlog=64)
    print(f"READY {srv.getsockname()[0]}:{srv.getsockname()[1]}", flush=True)
    fd = os.open(path, os.O_RDONLY)

    def one(c: socket.socket) -> None:
        with c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                hdr = c.recv(16, socket.MSG_WAITALL)
                if len(hdr) < 16:
                    return
                off, n = struct.unpack(">QQ", hdr)
                while n:
                    k = os.sendfile(c.fileno(), fd, off, n)
                    if not k:
                        return
                    off, n = off + k, n - k
    while True:
        c, _ = srv.accept()
        threading.Thread(target=one, args=(c,), daemon=True).start()


def main(argv: list[str]) -> None:
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if argv and argv[0] == "--plain":
        plain_serve(argv[1], os.path.join(argv[2], argv[3]))
        return
    from acache.net.auth import load_secret
    from acache.net.tcp import TcpTransport
    listen, root = argv[0], argv[1]
    secret = load_secret(argv[2]) if len(argv) > 2 else None
    lst = TcpTransport(secret, timeout=5.0).listen(listen)
    FileServer(root).register(lst)
    lst.start()
    print(f"READY {lst.address}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1:])
