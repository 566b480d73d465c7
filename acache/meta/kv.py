"""The KV seam: every metadata engine reduces to get / scan / atomic batch.

A batch is applied atomically; ``sync=True`` makes it durable against a host
crash before returning (fsync of the WAL), ``sync=False`` only against a crash
of the process (the WAL is written to the OS at once).
"""
from __future__ import annotations

from typing import Iterator, Protocol


class KV(Protocol):
    def get(self, key: bytes) -> bytes | None: ...

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """All pairs whose key starts with ``prefix``, in key order."""

    def write(self, puts: dict[bytes, bytes], deletes: list[bytes] | tuple = (),
              sync: bool = False) -> None:
        """Apply deletes then puts, atomically."""

    def close(self) -> None: ...


def open_kv(url: str) -> KV:
    """``rocksdb:///path``, ``mem://`` or ``etcd://h1:2379,h2:2379/NAME`` (a cluster)."""
    if url.startswith("mem://"):
        from acache.meta.kv_mem import MemKV
        return MemKV()
    if url.startswith("rocksdb://"):
        from acache.meta.kv_rocks import RocksKV
        return RocksKV(url[len("rocksdb://"):])
    if url.startswith("etcd://"):
        from acache.meta.kv_etcd import EtcdKV
        return EtcdKV.open(url)
    raise ValueError(f"unknown KV url {url!r}")
