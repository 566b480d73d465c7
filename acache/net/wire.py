"""Peer frames: a fixed, versioned header, msgpack meta, then the raw payload.

    offset size  field
         0    4  magic        b"ACPR"
         4    1  version      VERSION (1); anything else is refused
         5    1  type         HELLO/PROOF/READY (handshake), REQUEST, REPLY, ERROR
         6    2  flags        none defined in version 1: must be 0
         8    8  request id   chosen by the client, echoed by the reply (0 in the handshake)
        16    4  meta length  bytes of msgpack after the header
        20    8  payload len  raw bytes after the meta
        28    4  reserved     must be 0
    (32 bytes, big-endian)

Both lengths are checked against the receiver's limits from the header alone, before a byte
of meta or payload is read.  Meta is a msgpack value (a request: [op, {meta}], a reply: {meta},
an error: {"errno": int, "msg": str}).  Payloads are never joined with the header: the sender
passes [header, meta, payload] to one ``sendmsg`` (or follows the header with ``sendfile``
from a file region), the receiver ``recv_into``s a memoryview of the destination buffer.

The control socket keeps its own simpler framing (acache.net.frame).
"""
from __future__ import annotations

import errno
import os
import select
import socket
import struct
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import msgpack

from acache.net.transport import FileRegion, FrameError

MAGIC = b"ACPR"
VERSION = 1
HELLO, PROOF, READY, REQUEST, REPLY, ERROR = 1, 2, 3, 4, 5, 6
TYPES = {HELLO, PROOF, READY, REQUEST, REPLY, ERROR}
_HDR = struct.Struct(">4sBBHQIQI")
HEADER = _HDR.size       # 32


@dataclass(frozen=True)
class Limits:
    max_meta: int = 1 << 20
    max_payload: int = 64 << 20


HANDSHAKE_LIMITS = Limits(max_meta=4096, max_payload=0)


class Header(NamedTuple):
    type: int
    flags: int
    rid: int
    meta_len: int
    payload_len: int


def pack_header(ftype: int, rid: int, meta_len: int, payload_len: int = 0, flags: int = 0) -> bytes:
    return _HDR.pack(MAGIC, VERSION, ftype, flags, rid, meta_len, payload_len, 0)


def parse_header(raw: bytes | bytearray | memoryview, limits: Limits,
                 allowed: frozenset[int] | set[int] = TYPES) -> Header:
    magic, version, ftype, flags, rid, mlen, plen, reserved = _HDR.unpack(raw)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise FrameError(f"protocol version {version} (we speak {VERSION})")
    if ftype not in allowed:
        raise FrameError(f"unexpected frame type {ftype}")
    if flags or reserved:
        raise FrameError(f"unknown flags {flags:#x} / reserved {reserved:#x}")
    if mlen > limits.max_meta:
        raise FrameError(f"meta of {mlen} bytes is too large (limit {limits.max_meta})")
    if plen > limits.max_payload:
        raise FrameError(f"payload of {plen} bytes is too large (limit {limits.max_payload})")
    return Header(ftype, flags, rid, mlen, plen)


def encode_meta(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def decode_meta(raw: bytes | bytearray | memoryview) -> object:
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:    # msgpack raises several unrelated types for malformed input
        raise FrameError(f"meta is not msgpack: {type(e).__name__}") from None


def decode_map(raw: bytes | bytearray | memoryview) -> dict:
    obj = decode_meta(raw)
    if not isinstance(obj, dict):
        raise FrameError(f"meta must be a map, got {type(obj).__name__}")
    return obj


def decode_request(raw: bytes | bytearray | memoryview) -> tuple[str, dict]:
    obj = decode_meta(raw)
    if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], str)
            and isinstance(obj[1], dict)):
        raise FrameError("a request's meta must be [op, {meta}]")
    return obj[0], obj[1]


# -- socket I/O (OSError/ConnectionError out: the caller translates at its edge) -----------
def recv_into_exact(sock: socket.socket, buf: memoryview, on_progress=None) -> None:
    """Fill ``buf`` from ``sock`` (a timeout is the socket's, per recv)."""
    got, n = 0, len(buf)
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if not k:
            raise ConnectionError("connection closed by the peer")
        got += k
        if on_progress is not None:
            on_progress()


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return buf


def send_buffers(sock: socket.socket, bufs: Sequence[bytes | bytearray | memoryview]) -> None:
    """Send every buffer in order with as few syscalls as the kernel allows, copying none."""
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    while views:
        sent = sock.sendmsg(views[:64])        # IOV_MAX is 1024; a few suffice
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def send_region(sock: socket.socket, region: FileRegion, timeout: float | None) -> None:
    """``region.length`` bytes of ``region.fd`` to ``sock`` with sendfile (the kernel copies
    from the page cache).  A file shorter than the region breaks the frame: ConnectionError."""
    off, left = region.offset, region.length
    fd = sock.fileno()
    poller = None
    while left:
        try:
            n = os.sendfile(fd, region.fd, off, min(left, 1 << 30))
        except (BlockingIOError, InterruptedError):
            if poller is None:
                poller = select.poll()
                poller.register(fd, select.POLLOUT)
            if not poller.poll(None if timeout is None else timeout * 1000):
                raise TimeoutError(errno.ETIMEDOUT, "sendfile: the peer stopped reading")
            continue
        if n == 0:
            raise ConnectionError(f"file region ends {left} bytes early (file truncated?)")
        off += n
        left -= n
