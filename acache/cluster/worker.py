"""A worker's side of placed files: write sessions of cacheless clients on this node's cache.

A node without a cache (``placement = "hash"``, acache.cluster.cacheless) writes each file
it creates into the cache of the worker the head placed it on (acache.cluster.placement).
The worker serves, over the peer transport:

    data.open      {ino, gen, src?, trunc}  -> {size}   the cache file of (ino, gen): made
                   empty, or filled from generation ``src`` (a copy, as a local open would);
                   a *session* holds its fd open until data.end
    data.write     {ino, gen, offset} + payload -> {end}  pwrite at the offset; accounted
                   in the CacheDir as a local write (dirty; waits for room: backpressure)
    data.truncate  {ino, gen, size} -> {}
    data.fsync     {ino, gen} -> {size, mtime_ns}     durable here (file and directory)
    data.close     {ino, gen} -> {size, mtime_ns, ctime_ns}   what the head's close records
    data.end       {ino, gen} -> {}                   the client's last handle went: fd closed

A request for a session this process does not have (it restarted since data.open) is
ESTALE: the client's file fails with EIO, its bytes on this disk are the worker's to replay
(ClientVFS.recover, then the head's rejoin publishes what an fsync acknowledged).

Writes of one file may be served out of order (the transport's handlers run in parallel);
the client never has two overlapping writes of a file in flight (acache.cluster.remote_write),
so the bytes on disk are those of the order it wrote them in.
"""
from __future__ import annotations

import errno
import logging
import os
import threading

log = logging.getLogger("acache.cluster.worker")


class WriteSessions:
    OPS = ("open", "write", "truncate", "fsync", "close", "end")

    def __init__(self, vfs, cache) -> None:
        self.vfs, self.cache = vfs, cache       # this node's ClientVFS and CacheDir
        self._lock = threading.Lock()
        self._fds: dict[tuple[int, int], int] = {}
        self.bytes_written = 0

    def register(self, listener) -> None:
        for op in self.OPS:
            listener.register(f"data.{op}", getattr(self, f"_{op}"))

    @staticmethod
    def _key(meta: dict) -> tuple[int, int]:
        ino, gen = meta.get("ino"), meta.get("gen")
        if not (isinstance(ino, int) and ino >= 0 and isinstance(gen, int) and gen >= 0):
            raise OSError(errno.EINVAL, "bad write-session request")
        return ino, gen

    def _fd(self, key: tuple[int, int]) -> int:
        fd = self._fds.get(key)
        if fd is None:
            raise OSError(errno.ESTALE, f"no write session of inode {key[0]} generation {key[1]} "
                                        "here (this node restarted?)")
        return fd

    def _open(self, meta: dict, payload) -> dict:
        key = self._key(meta)
        with self._lock:
            if key in self._fds:                  # the same session, opened again
                if meta.get("trunc"):
                    os.ftruncate(self._fds[key], 0)
                return {"size": os.fstat(self._fds[key]).st_size}
        ino, gen = key
        self.cache.wait_for_room()
        self.cache.create_empty(ino, gen)
        src = meta.get("src")
        if src:
            self.vfs._copy(ino, gen, src)         # clone here, or from its holder / the under-storage
        fd = self.cache.acquire(ino, gen, create=True, write=True)
        self.cache.note(ino, gen, dirty=True)
        with self._lock:
            if key in self._fds:                  # raced with itself: keep one
                self.cache.release(ino, gen, write=True)
                fd = self._fds[key]
            else:
                self._fds[key] = fd
        return {"size": os.fstat(fd).st_size}

    def _write(self, meta: dict, payload) -> dict:
        key = self._key(meta)
        off = meta.get("offset")
        if not isinstance(off, int) or off < 0:
            raise OSError(errno.EINVAL, "bad write offset")
        fd = self._fd(key)
        data = memoryview(payload)
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], off + done)
        self.bytes_written += done
        self.cache.grow(key[0], key[1], off + done)   # dirty, accounted; waits for room
        return {"end": off + done}

    def _truncate(self, meta: dict, payload) -> dict:
        key = self._key(meta)
        os.ftruncate(self._fd(key), int(meta["size"]))
        return {}

    def _fsync(self, meta: dict, payload) -> dict:
        key = self._key(meta)
        fd = self._fd(key)
        os.fsync(fd)
        d = os.open(self.cache.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(d)
        finally:
            os.close(d)
        s = os.fstat(fd)
        return {"size": s.st_size, "mtime_ns": s.st_mtime_ns}

    def _close(self, meta: dict, payload) -> dict:
        key = self._key(meta)
        s = os.fstat(self._fd(key))
        self.cache.note(key[0], key[1], dirty=True, size=s.st_blocks * 512)
        return {"size": s.st_size, "mtime_ns": s.st_mtime_ns, "ctime_ns": s.st_ctime_ns}

    def _end(self, meta: dict, payload) -> dict:
        key = self._key(meta)
        with self._lock:
            fd = self._fds.pop(key, None)
        if fd is not None:
            self.cache.release(key[0], key[1], write=True)
            self.vfs._maybe_drop(*key)
        return {}

    def sessions(self) -> int:
        return len(self._fds)
