"""The RocksDB KV (rocksdict).  Only the node daemon opens it.

WAL recovery: tolerate a torn *tail* record, refuse any other damage (paranoid checks).
A record at the very end of the log that was not written whole is a batch whose write
never returned: a failed write (ENOSPC: it was reported to its caller as EIO), or one cut
by a crash of the host (unsynced, so by the contract not acknowledged against a host
crash; acknowledged writes are synced or complete).  Refusing to start over such a tail
would stop every node after a power loss for nothing acknowledged, and would make the
reopen after a full disk (below) fail.  Damage anywhere else (a bad record in the middle,
a checksum mismatch) makes the open fail: the node refuses to start with one line naming
the damage; the operator keeps a copy and starts once with ACACHE_META_SALVAGE=1
(point-in-time recovery: the intact prefix of the log).  Whatever a recovery drops, or a
WAL deleted outright (undetectable by RocksDB), shows at start as cache files the metadata
no longer knows: they are moved to <cache>/lost+found and reported (VFS.recover), never
deleted.

A failed write (ENOSPC on the WAL, an I/O error) leaves RocksDB refusing every later
write ("Writer has previous error") until it is reopened; rocksdict has no DB::Resume.
So a failed write releases the metadata reserve (acache.meta.reserve), reopens the
database (the WAL replays what was acknowledged; the failed batch is not in it, or is
whole, or is a torn tail) and retries the batch once; only then does the error reach the
caller.
"""
from __future__ import annotations

import logging
import os
from typing import Iterator

from rocksdict import AccessType, DBRecoveryMode, Options, Rdict, WriteBatch, WriteOptions

from acache.errors import ConfigError
from acache.meta.reserve import Reserve

log = logging.getLogger("acache.meta")

SALVAGE_ENV = "ACACHE_META_SALVAGE"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class RocksKV:
    def __init__(self, path: str, reserve: Reserve | None = None) -> None:
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)      # it holds names from private directories
        self.path = path
        self.reserve = reserve
        self.salvage = os.environ.get(SALVAGE_ENV, "") not in ("", "0")
        self._db: Rdict | None = None
        try:
            try:
                self._open()
            except Exception:       # rocksdict raises plain Exception (LOCK held, ENOSPC...)
                if not (reserve is not None and reserve.release()):
                    raise
                self._open()        # a full disk: the reserve is there for this
        except Exception as e:
            msg = _first_line(e)
            if "corrupt" in msg.lower():
                raise ConfigError(
                    f"the metadata database at {path} is damaged ({msg}): refusing to start "
                    "rather than drop what it recorded; keep a copy of that directory, then "
                    f"start once with {SALVAGE_ENV}=1 to recover its intact part (cache files "
                    "it lost go to lost+found, see `acache status`)") from None
            raise ConfigError(f"cannot open the metadata database at {path}: {msg}") from None
        if self.salvage:
            log.warning("%s=1: the metadata database at %s was opened with point-in-time "
                        "recovery (records after a damaged part of its log are dropped)",
                        SALVAGE_ENV, path)
        self._sync = WriteOptions()
        self._sync.sync = True
        self._nosync = WriteOptions()
        self._nosync.sync = False

    def _open(self) -> None:
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_paranoid_checks(True)
        opts.set_wal_recovery_mode(DBRecoveryMode.point_in_time() if self.salvage
                                   else DBRecoveryMode.tolerate_corrupted_tail_records())
        self._db = Rdict(self.path, options=opts, access_type=AccessType.read_write())

    def _live(self) -> Rdict:
        if self._db is None:        # a reopen failed: try again
            self._open()
        assert self._db is not None
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

    def _write(self, puts, deletes, opts) -> None:
        if len(puts) == 1 and not deletes:      # one record (a utime, a chmod): a plain put
            for k, v in puts.items():           # is atomic too, and 3x cheaper than a batch
                self._live().put(k, v, opts)
            return
        self._live().write(self._batch(puts, deletes), opts)

    def write(self, puts, deletes=(), sync=False) -> None:
        opts = self._sync if sync else self._nosync
        try:
            self._write(puts, deletes, opts)
        except Exception as e:
            released = self.reserve is not None and self.reserve.release()
            log.warning("metadata write failed (%s); %sreopening the database and retrying", e,
                        "released the reserve, " if released else "")
            self._reopen()
            self._write(puts, deletes, opts)    # a second failure is the caller's
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
