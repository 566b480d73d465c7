"""An in-memory KV for unit tests (same contract as RocksDB, no durability)."""
from __future__ import annotations

import bisect
import threading
from typing import Iterator


class MemKV:
    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}
        self._keys: list[bytes] = []
        self._lock = threading.Lock()

    def get(self, key: bytes) -> bytes | None:
        return self._data.get(key)

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        with self._lock:
            i = bisect.bisect_left(self._keys, prefix)
            out = []
            while i < len(self._keys) and self._keys[i].startswith(prefix):
                out.append((self._keys[i], self._data[self._keys[i]]))
                i += 1
        return iter(out)

    def write(self, puts, deletes=(), sync=False) -> None:
        with self._lock:
            for k in deletes:
                if k in self._data:
                    del self._data[k]
                    self._keys.pop(bisect.bisect_left(self._keys, k))
            for k, v in puts.items():
                if k not in self._data:
                    bisect.insort(self._keys, k)
                self._data[k] = bytes(v)

    def close(self) -> None:
        pass
