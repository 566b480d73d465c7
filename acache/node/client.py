"""The CLI's side of the control socket."""
from __future__ import annotations

import socket
from pathlib import Path

from acache import errors
from acache.errors import DaemonError
from acache.net import frame


class Client:
    def __init__(self, path: Path | str, timeout: float | None = 30.0) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError):
            self.sock.close()
            raise DaemonError(f"no acache node is running (no daemon at {self.path}); "
                              "start one with `acache up`") from None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def call(self, op: str, on_progress=None, **args):
        frame.send(self.sock, {"op": op, **args})
        while True:
            try:
                rep = frame.recv(self.sock)
            except (ConnectionError, OSError) as e:
                raise DaemonError(f"the acache node went away during {op!r}: {e}") from None
            if "progress" in rep:
                if on_progress is not None:
                    on_progress(rep["progress"])
                continue
            if "error" in rep:
                cls = getattr(errors, rep.get("kind", ""), None)
                if not (isinstance(cls, type) and issubclass(cls, errors.AcacheError)) \
                        or cls is errors.FsError:
                    cls = errors.AcacheError
                raise cls(rep["error"]) if cls not in (errors.UnderStoreError,) else \
                    errors.AcacheError(rep["error"])
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
