"""The control socket: the CLI's requests to the node daemon, one thread each.

Requests and replies are frames (acache.net.frame): {"op": ..., args...} ->
{"ok": result} | {"error": message, "kind": class name}; `flush` streams
{"progress": {...}} frames before its final reply.
"""
from __future__ import annotations

import logging
import os
import socket
import threading

from acache.errors import AcacheError
from acache.net import frame
from acache.node.daemon import Node

log = logging.getLogger("acache.server")


class ControlServer:
    def __init__(self, node: Node, path: str) -> None:
        self.node, self.path = node, path
        if os.path.exists(path):
            os.unlink(path)           # the caller made sure no live daemon owns it
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        os.chmod(path, 0o600)
        self.sock.listen(64)
        self._stop = threading.Event()

    def serve(self) -> None:
        self.sock.settimeout(0.5)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def stop(self) -> None:
        self._stop.set()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                req = frame.recv(conn)
            except (ConnectionError, ValueError):
                return
            op = req.get("op")
            try:
                result = self._dispatch(op, req, conn)
                frame.send(conn, {"ok": result})
            except AcacheError as e:
                self._reply_error(conn, e)
            except Exception as e:   # a bug: say so, keep the daemon alive
                log.exception("control request %r failed", op)
                self._reply_error(conn, e)
            if op == "down" and self.node.stopping.is_set():
                self.stop()

    @staticmethod
    def _reply_error(conn, e: Exception) -> None:
        try:
            frame.send(conn, {"error": str(e) or type(e).__name__, "kind": type(e).__name__})
        except OSError:
            pass

    def _dispatch(self, op: str, req: dict, conn: socket.socket):
        n = self.node
        if op == "ping":
            return {"pid": os.getpid(), "mountpoint": n.mountpoint}
        if op == "status":
            return n.status(req.get("path"))
        if op == "mount":
            return n.mount(req["path"], req.get("engine") or "")
        if op == "umount":
            return n.umount(req.get("path"))
        if op == "flush":
            def progress(info: dict) -> None:
                frame.send(conn, {"progress": info})
            return n.flush(req.get("path"), req.get("timeout"), progress)
        if op == "journal":
            return n.journal(req.get("limit") or 100)
        if op == "journal_skip":
            return n.journal_skip(req["seq"], req.get("reason") or "")
        if op == "down":
            return n.shutdown(flush=req.get("flush", True), timeout=req.get("timeout"))
        raise AcacheError(f"unknown request {op!r}")
