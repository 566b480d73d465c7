"""Length-prefixed frames: a 4-byte big-endian length, then a msgpack map.

Used by the CLI <-> daemon control socket (and the peer RPC to come).
"""
from __future__ import annotations

import socket
import struct

import msgpack

_LEN = struct.Struct(">I")
HEADER = _LEN.size
MAX_FRAME = 64 << 20      # a reply (a status with every file under a path can be large)
MAX_REQUEST = 1 << 20     # a request: an op and a few paths and numbers


class FrameError(ValueError):
    """Not a frame we accept: too large, not msgpack, or not a map."""


def send(sock: socket.socket, obj: dict) -> None:
    body = msgpack.packb(obj, use_bin_type=True, unicode_errors="surrogateescape")
    sock.sendall(_LEN.pack(len(body)) + body)


def body_size(header: bytes, limit: int = MAX_FRAME) -> int:
    """The body length a header announces, refused before anything is read if over ``limit``."""
    (n,) = _LEN.unpack(header)
    if n > limit:
        raise FrameError(f"frame of {n} bytes is too large (limit {limit})")
    return n


def decode(body: bytes) -> dict:
    try:
        obj = msgpack.unpackb(body, raw=False, unicode_errors="surrogateescape")
    except Exception as e:    # msgpack raises several unrelated types for malformed input
        raise FrameError(f"not a msgpack frame: {type(e).__name__}") from None
    if not isinstance(obj, dict):
        raise FrameError(f"a frame must be a map, got {type(obj).__name__}")
    return obj


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket, limit: int = MAX_FRAME) -> dict:
    n = body_size(_exact(sock, HEADER), limit)
    return decode(_exact(sock, n))
