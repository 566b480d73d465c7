"""Length-prefixed frames: a 4-byte big-endian length, then a msgpack map.

Used by the CLI <-> daemon control socket (and the peer RPC to come).
"""
from __future__ import annotations

import socket
import struct

import msgpack

_LEN = struct.Struct(">I")
MAX_FRAME = 64 << 20


def send(sock: socket.socket, obj: dict) -> None:
    body = msgpack.packb(obj, use_bin_type=True, unicode_errors="surrogateescape")
    sock.sendall(_LEN.pack(len(body)) + body)


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(_exact(sock, 4))
    if n > MAX_FRAME:
        raise ConnectionError(f"frame of {n} bytes is too large")
    return msgpack.unpackb(_exact(sock, n), raw=False, unicode_errors="surrogateescape")
