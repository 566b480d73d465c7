"""Room kept for the metadata on the filesystem that the cache fills.

The RocksDB lives next to the cache files (``<cache_dir>/meta``), so a full cache disk
would stop every metadata write -- and a write-back cache whose journal cannot grow can
neither take a close nor record that something was persisted.  Two lines of defence:

1. the cache's limit keeps ``size`` bytes of the filesystem free (CacheDir asks
   ``keep()``), so daemon-served writes stop (backpressure) before the disk is full;
2. a *ballast* file of ``size`` bytes, preallocated next to the database, for what the
   limit cannot stop (files open with kernel passthrough write past it, other programs
   on the same filesystem): when a metadata write fails, the KV releases the ballast and
   retries; the ballast is made again once the filesystem has room for it and the
   ``size`` the limit keeps free.

``size = 0`` turns both off.
"""
from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger("acache.meta")


class Reserve:
    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size
        self._lock = threading.Lock()
        self._next_try = 0.0
        self.held = self._held()
        if not self.held:
            self.refill()

    def _held(self) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return self.size > 0 and st.st_blocks * 512 >= self.size

    def keep(self) -> int:
        """Bytes the cache must leave free on the filesystem: the reserve, and room to
        make the ballast again while it is released."""
        return self.size if self.held else 2 * self.size

    def release(self) -> bool:
        """Give the ballast's room to the metadata; True if there was one to give."""
        with self._lock:
            if not self.held:
                return False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.held = False
            self._next_try = time.monotonic() + 1.0
        log.warning("the cache filesystem is full: released the %d MiB metadata reserve (%s); "
                    "made again when there is room", self.size >> 20, self.path)
        return True

    def refill(self, force: bool = False) -> None:
        """Make the ballast if the filesystem has room for it and the free ``size`` after
        it (cheap when held; at most once a second otherwise)."""
        if self.held or self.size <= 0:
            return
        with self._lock:
            now = time.monotonic()
            if self.held or (now < self._next_try and not force):
                return
            self._next_try = now + 1.0
            st = os.statvfs(os.path.dirname(self.path) or ".")
            if st.f_bavail * st.f_frsize < 2 * self.size:
                return
            tmp = self.path + ".tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    os.posix_fallocate(fd, 0, self.size)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, self.path)
            except OSError as e:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                log.warning("cannot make the metadata reserve %s: %s", self.path, e.strerror)
                return
            self.held = True
        log.info("metadata reserve of %d MiB in place (%s)", self.size >> 20, self.path)
