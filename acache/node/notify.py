"""systemd readiness (Type=notify) without a library: a datagram to $NOTIFY_SOCKET.

``$NOTIFY_SOCKET`` is a unix datagram socket path, or an abstract-namespace name when it
starts with ``@`` (the ``@`` stands for the leading NUL byte).  No variable: nothing to
do (not run by systemd).  A failure to send is logged, never fatal: the node works the
same, systemd just times out its start.
"""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("acache.notify")


def notify(state: str, env: dict | None = None) -> bool:
    """Send ``state`` (e.g. "READY=1", "STOPPING=1", "STATUS=..."); True if it was sent."""
    addr = (env if env is not None else os.environ).get("NOTIFY_SOCKET", "")
    if not addr:
        return False
    if addr[0] not in "/@":
        log.warning("NOTIFY_SOCKET=%r is neither a path nor an abstract name (@...): ignored", addr)
        return False
    target = "\0" + addr[1:] if addr[0] == "@" else addr
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(state.encode(), target)
        return True
    except OSError as e:
        log.warning("telling systemd %s through %s failed: %s", state, addr, e)
        return False
