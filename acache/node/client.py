"""The CLI's side of the control socket."""
from __future__ import annotations

import socket
import time
from pathlib import Path

from acache import errors
from acache.errors import DaemonError
from acache.net import frame


# the daemon's error kinds the CLI tells apart; anything else is a plain AcacheError
_KINDS = {c.__name__: c for c in (errors.ConfigError, errors.DaemonError, errors.FlushError)}


class Client:
    def __init__(self, path: Path | str, timeout: float | None = 30.0) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        deadline = time.monotonic() + (timeout if timeout is not None else 30.0)
        while True:
            try:
                self.sock.connect(self.path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                self.sock.close()
                raise DaemonError(f"no acache node is running (no daemon at {self.path}); "
                                  "start one with `acache up`") from None
            except BlockingIOError:   # the node's accept backlog is full: a burst of clients
                if time.monotonic() > deadline:
                    self.sock.close()
                    raise DaemonError(f"the acache node at {self.path} accepts no connection "
                                      "(its backlog is full)") from None
                time.sleep(0.01)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def call(self, op: str, on_progress=None, **args):
        frame.send(self.sock, {"op": op, **args})
        while True:
            try:
                rep = frame.recv(self.sock)
            except (ConnectionError, OSError, frame.FrameError) as e:
                raise DaemonError(f"the acache node went away during {op!r}: {e}") from None
            if "progress" in rep:
                if on_progress is not None:
                    on_progress(rep["progress"])
                continue
            if "error" in rep:
                kind = rep.get("kind", "")
                cls = _KINDS.get(kind, errors.AcacheError)
                raise cls(rep["error"])
            return rep.get("ok")

    def flush(self, path: str | None, timeout: float | None, on_progress=None) -> dict:
        self.sock.settimeout(None)
        return self.call("flush", on_progress, path=path, timeout=timeout)


def is_running(path: Path | str) -> bool:
    try:
        with Client(path, timeout=5) as c:
            c.call("ping")
        return True
    except (DaemonError, OSError):
        return False
