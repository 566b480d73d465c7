"""The RocksDB KV (rocksdict).  Only the node daemon opens it."""
from __future__ import annotations

import os
from typing import Iterator

from rocksdict import AccessType, Options, Rdict, WriteBatch, WriteOptions

from acache.errors import ConfigError


class RocksKV:
    def __init__(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        try:
            self._db = Rdict(path, options=opts, access_type=AccessType.read_write())
        except Exception as e:  # rocksdict raises plain Exception (e.g. LOCK held)
            raise ConfigError(f"cannot open the metadata database at {path}: {e}") from None
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
