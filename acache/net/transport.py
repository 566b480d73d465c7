"""The peer transport seam: how one node asks another for metadata and file bytes.

A server side (``Listener``) registers a handler per op name; a client side (``Conn``, one
per peer, safe to share between threads) sends requests and reads bulk data straight into
the caller's buffer.  Implementations: acache.net.tcp, and acache.net.rdma (bulk data by RDMA
READ, everything else on its TCP connection).  Each side advertises a capability dict at
connect (acache.net.auth); the peer's is on the Conn, so callers ask the Protocol instead of
looking at the implementation class; so is the path bulk data takes to that peer
(``Conn.path``: RDMA is negotiated per peer, acache.net.rdma).

Errors (translated only at the edges: socket/OS errors in the transport, a handler's
errno on the serving side):

    TransportError (AcacheError)    errno         retryable
    ├── PeerUnavailable             EHOSTUNREACH  yes  refused, unreachable, timed out, lost mid-reply
    ├── AuthError                   EACCES        no   handshake refused: no/wrong secret, bad proof
    ├── ProtocolError               EPROTO        no   the peer does not speak our protocol/version
    │   └── FrameError              EPROTO        no   a malformed frame (magic, size, msgpack...)
    └── RemoteError                 (given)       (given) the serving handler failed with an errno
"""
from __future__ import annotations

import errno as _errno
import os
from dataclasses import dataclass, field
from typing import Callable, Protocol, Union

from acache.errors import AcacheError

__all__ = ["TransportError", "PeerUnavailable", "AuthError", "ProtocolError", "FrameError",
           "RemoteError", "FileRegion", "Reply", "Handler", "Listener", "Conn", "Transport"]


class TransportError(AcacheError):
    errno = _errno.EIO


class PeerUnavailable(TransportError):
    errno = _errno.EHOSTUNREACH
    retryable = True


class AuthError(TransportError):
    errno = _errno.EACCES


class ProtocolError(TransportError):
    errno = _errno.EPROTO


class FrameError(ProtocolError):
    """Not a frame we accept: bad magic/version/type/flags, too large, not msgpack."""


_RETRYABLE_ERRNOS = {_errno.EAGAIN, _errno.EBUSY, _errno.EINTR, _errno.ETIMEDOUT}


class RemoteError(TransportError):
    """The serving side's handler failed; ``errno`` is what it raised there."""

    def __init__(self, err: int, msg: str = "") -> None:
        super().__init__(msg or os.strerror(err))
        self.errno = err
        self.retryable = err in _RETRYABLE_ERRNOS


@dataclass
class FileRegion:
    """A reply payload read from a file by the transport itself (sendfile on TCP): ``length``
    bytes of ``fd`` from ``offset``.  ``release`` (if given) is called once the region is sent
    or abandoned; the fd stays the handler's."""
    fd: int
    offset: int
    length: int
    release: Callable[[], None] | None = None


@dataclass
class Reply:
    meta: dict = field(default_factory=dict)
    payload: bytes | bytearray | memoryview | FileRegion = b""


# (request meta, request payload) -> a Reply, or just its meta.  Raising OSError/AcacheError
# answers RemoteError with that errno; anything else is a bug: logged, answered EIO.
Handler = Callable[[dict, memoryview], Union[Reply, dict]]


class Listener(Protocol):
    address: str                       # "host:port" actually bound (port 0 -> the real one)

    def register(self, op: str, handler: Handler, *, inline: bool = False) -> None:
        """``inline``: the handler never blocks (memory, page cache): it may run on the thread
        that reads the connection, saving a handoff; the connection waits while it runs."""
        ...
    def advertise(self, key: str, value: object) -> None:
        """One more entry of the handshake (``peer_capabilities`` on the other side)."""
        ...
    def start(self) -> None: ...       # serve in background threads
    def close(self) -> None: ...       # stop accepting, drop every connection


class Conn(Protocol):
    """Requests to one peer.  Several may be in flight at once, from any threads."""
    peer_capabilities: dict            # what the peer advertised at the handshake
    # how bulk data moves now, and why: "rdma", "tcp" (a TCP-only transport), or "tcp: <why>"
    # ("tcp: peer has no RDMA device", "tcp: fell back after IBV_WC_RETRY_EXC_ERR at 21:04:11");
    # it may change once, from "rdma" to "tcp: fell back ..."; stats() has it too
    path: str

    def request(self, op: str, meta: dict, payload: bytes | bytearray | memoryview = b"", *,
                timeout: float | None = None) -> tuple[dict, bytes | bytearray]: ...

    def read_into(self, op: str, meta: dict, buf: memoryview, *,
                  timeout: float | None = None) -> int:
        """The reply's payload lands in ``buf`` (no extra copy); returns its length.  A reply
        larger than ``buf`` is a ProtocolError."""
        ...

    def stats(self) -> dict: ...       # transport, path, requests, bytes_in, bytes_out, streams (TCP)
    def close(self) -> None: ...


class Transport(Protocol):
    name: str                          # "tcp", "rdma"
    capabilities: dict                 # what this side advertises (auth.py adds version, ops)

    def listen(self, address: str) -> Listener: ...
    def connect(self, address: str) -> Conn: ...
