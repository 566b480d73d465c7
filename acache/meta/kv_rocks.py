"""The RocksDB KV (rocksdict).  Only the node daemon opens it."""
from __future__ import annotations

import logging
import os
from typing import Iterator

from rocksdict import AccessType, DBRecoveryMode, Options, Rdict, WriteBatch, WriteOptions

from acache.errors import ConfigError

log = logging.getLogger("acache.meta")


SALVAGE_ENV = "ACACHE_META_SALVAGE"


class RocksKV:
    """WAL recovery: absolute consistency, with paranoid checks.  A damaged write-ahead
    log (a torn or truncated tail, a bad record) makes the open fail instead of
    silently replaying a prefix of it: the records lost would be closed files, renames
    and deletes that acache acknowledged, and their cache files would then look
    unknown.  The node refuses to start with one line naming the damage; the operator
    can keep a copy and start once with ACACHE_META_SALVAGE=1 (point-in-time recovery:
    the intact prefix of the log), after which the cache files the metadata no longer
    knows are moved to <cache>/lost+found and reported, never deleted.  A WAL that was
    deleted outright is undetectable by RocksDB; acache catches that case by the same
    lost+found check at start (VFS.recover)."""

    def __init__(self, path: str) -> None:
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)      # it holds names from private directories
        salvage = os.environ.get(SALVAGE_ENV, "") not in ("", "0")
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_paranoid_checks(True)
        opts.set_wal_recovery_mode(DBRecoveryMode.point_in_time() if salvage
                                   else DBRecoveryMode.absolute_consistency())
        try:
            self._db = Rdict(path, options=opts, access_type=AccessType.read_write())
        except Exception as e:  # rocksdict raises plain Exception (e.g. LOCK held)
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "Corruption" in msg or "corrupt" in msg.lower():
                raise ConfigError(
                    f"the metadata database at {path} is damaged ({msg}): refusing to start "
                    "rather than drop what it recorded; keep a copy of that directory, then "
                    f"start once with {SALVAGE_ENV}=1 to recover its intact part (cache files "
                    "it lost go to lost+found, see `acache status`)") from None
            raise ConfigError(f"cannot open the metadata database at {path}: {msg}") from None
        if salvage:
            log.warning("%s=1: the metadata database at %s was opened with point-in-time "
                        "recovery (records after a damaged part of its log are dropped)",
                        SALVAGE_ENV, path)
        self._sync = WriteOptions()
        self._sync.sync = True
        self._nosync = WriteOptions()
        self._nosync.sync = False

    def get(self, key: bytes) -> bytes | None:
        return self._db.get(key)

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        it = self._db.iter()
        it.seek(prefix)
        while it.valid():
            k = it.key()
            if not k.startswith(prefix):
                break
            yield k, it.value()
            it.next()

    def write(self, puts, deletes=(), sync=False) -> None:
        wb = WriteBatch(raw_mode=True)
        for k in deletes:
            wb.delete(k)
        for k, v in puts.items():
            wb.put(k, v)
        self._db.write(wb, self._sync if sync else self._nosync)

    def close(self) -> None:
        self._db.close()
