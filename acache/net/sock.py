"""Socket helpers both ends of the TCP transport use (acache.net.tcp, acache.net.tcp_server)."""
from __future__ import annotations

import errno
import logging
import os
import socket
import struct

log = logging.getLogger("acache.net")

_TIMEOUTS = (socket.timeout, TimeoutError)


def _tune(sock: socket.socket, bufsize: int, timeout: float) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if bufsize:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            if sock.getsockopt(socket.SOL_SOCKET, opt) < bufsize:
                sock.setsockopt(socket.SOL_SOCKET, opt, bufsize)   # capped by net.core.*mem_max
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_USER_TIMEOUT"):     # unacknowledged data fails the socket after this
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1000, int(timeout * 1000)))


def _kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Blocking socket, timeouts kept by the kernel (SO_RCVTIMEO/SO_SNDTIMEO: EAGAIN after
    ``seconds`` without progress).  Python's own timeouts would put the fd in non-blocking mode
    and poll before every recv/send/sendfile; this way a whole payload is one recv/sendfile."""
    sock.settimeout(None)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _why(e: BaseException) -> str:
    err = getattr(e, "errno", None)
    return os.strerror(err) if isinstance(err, int) and err > 0 else (str(e) or type(e).__name__)


def _errno_of(e: BaseException) -> int:
    err = getattr(e, "errno", None)
    return err if isinstance(err, int) and err > 0 else errno.EIO
