"""The RocksDB KV (rocksdict).  Only the node daemon opens it.

A failed write (ENOSPC on the WAL, an I/O error) leaves RocksDB refusing every later
write ("Writer has previous error") until it is reopened; rocksdict has no DB::Resume.
So a failed write releases the metadata reserve (acache.meta.reserve), reopens the
database (the WAL replays what was acknowledged; the failed batch is not in it, or is
whole) and retries the batch once; only then does the error reach the caller.
"""
from __future__ import annotations

import logging
import os
from typing import Iterator

from rocksdict import AccessType, Options, Rdict, WriteBatch, WriteOptions

from acache.errors import ConfigError
from acache.meta.reserve import Reserve

log = logging.getLogger("acache.meta")


class RocksKV:
    def __init__(self, path: str, reserve: Reserve | None = None) -> None:
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.reserve = reserve
        self._db: Rdict | None = None
        try:
            self._open()
        except Exception as e:  # rocksdict raises plain Exception (e.g. LOCK held, ENOSPC)
            if not (reserve is not None and reserve.release()):
                raise ConfigError(f"cannot open the metadata database at {path}: {e}") from None
            try:                # a full disk: the reserve is there for this
                self._open()
            except Exception as e2:
                raise ConfigError(f"cannot open the metadata database at {path}: {e2}") from None
        self._sync = WriteOptions()
        self._sync.sync = True
        self._nosync = WriteOptions()
        self._nosync.sync = False

    def _open(self) -> None:
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        self._db = Rdict(self.path, options=opts, access_type=AccessType.read_write())

    def _live(self) -> Rdict:
        if self._db is None:        # a reopen failed: try again
            self._open()
        return self._db

    def get(self, key: bytes) -> bytes | None:
        return self._live().get(key)

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        it = self._live().iter()
        it.seek(prefix)
        while it.valid():
            k = it.key()
            if not k.startswith(prefix):
                break
            yield k, it.value()
            it.next()

    @staticmethod
    def _batch(puts, deletes) -> WriteBatch:
        wb = WriteBatch(raw_mode=True)
        for k in deletes:
            wb.delete(k)
        for k, v in puts.items():
            wb.put(k, v)
        return wb

    def write(self, puts, deletes=(), sync=False) -> None:
        opts = self._sync if sync else self._nosync
        try:
            self._live().write(self._batch(puts, deletes), opts)
        except Exception as e:
            released = self.reserve is not None and self.reserve.release()
            log.warning("metadata write failed (%s); %sreopening the database and retrying", e,
                        "released the reserve, " if released else "")
            self._reopen()
            self._live().write(self._batch(puts, deletes), opts)   # a second failure is the caller's
        if self.reserve is not None:
            self.reserve.refill()

    def _reopen(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            try:
                db.close()
            except Exception as e:      # "Writer has previous error": closed all the same
                log.debug("closing the failed database: %s", e)
        self._open()

    def close(self) -> None:
        db, self._db = self._db, None
        if db is None:
            return
        try:
            db.close()
        except Exception as e:
            # a write failed and could not be retried: what was acknowledged is in the WAL
            # and replays at the next start; the failed batch was reported to its caller
            log.warning("closing the metadata database: %s", e)

