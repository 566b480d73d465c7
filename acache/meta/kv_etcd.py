"""The KV seam on etcd: ``etcd://h1:2379,h2:2379/NAME`` (keys under ``/acache/NAME/kv/``).

Keys are binary-safe (etcd keys are bytes; the schema's big-endian integers sort as they do
in RocksDB).  ``sync`` means nothing here: every committed txn is already in the raft log of
a quorum, fsynced, before etcd answers -- every write is what ``sync=True`` promises.

Layout under ``/acache/NAME/``:

    kv/<key>                    -> value      the user's pairs
    kvmeta/fence                -> <token>:<n> the writer's fence (below)
    kvmeta/intent               -> msgpack    a big batch being applied: {"id", "chunks"}
    kvmeta/intent-data/<id>/<i:u32> -> msgpack  its ops, chunk i: [[key, value|None], ...]

**One writer, fenced.**  Opening takes over the fence key (a txn guarded by its
mod_revision); every write txn compares the fence's mod_revision with the one this writer
last wrote and puts a fresh stamp ``<token>:<n>`` there.  So a writer another opener took
over gets :class:`MetaError` ("fenced off") at its next write instead of interleaving, and a
write whose reply was lost is resolved exactly: after a retry that comes back
``succeeded=False``, the fence holding this write's stamp means the first attempt applied;
the fence unchanged means nothing applied (sent again); anything else is a takeover.  A late
copy of an old txn can never land: the fence moved on.  (The newest opener wins, unlike
RocksDB's LOCK: a crashed node's successor needs no lease to expire.)

**Atomic batches of any size.**  A batch that fits one txn (<= 120 ops, <= 1 MiB: under
etcd's 128 ops and 1.5 MiB) is one fenced txn.  A bigger one:

1. its ops go into intent-data chunk records (plain puts, idempotent; invisible to readers),
2. one fenced txn puts the intent record (and requires none to exist): **the commit point**,
3. the chunks are applied, one txn each, each guarded by the intent's mod_revision (so a
   late copy cannot land once the intent is gone: applying is idempotent only while it exists),
4. one fenced txn deletes the intent and its chunks.

A reader (``get``, ``scan``) reads the intent record in the same txn as its keys; if it
finds one it applies the intent itself (idempotent, guarded as in 3) and reads again, so no
reader -- in this process or another -- sees half a batch.  An opener finishes an intent it
finds (the writer crashed between 2 and 4) and deletes chunk records no intent points to (a
writer that crashed during 1): the batch is applied exactly once or not at all.  A single
value over 1 MiB is refused (MetaError) before anything is written.
"""
from __future__ import annotations

import struct
import threading
import uuid
from typing import Iterator

import msgpack

from acache.errors import MetaError
from acache.meta.etcd import (Compare, Delete, EtcdClient, EtcdError, KeyValue, Op, Put, Range,
                              parse_url, prefix_end)

TXN_OPS = 120                   # < etcd's 128 (--max-txn-ops), room for the fence and guards
TXN_BYTES = 1024 * 1024         # < etcd's 1.5 MiB request limit, room for framing
_OP_OVERHEAD = 16


class EtcdKV:
    group_commit = True     # each write is a round trip: MetaStore writes behind (GroupCommit)

    def __init__(self, client: EtcdClient, namespace: bytes | None = None, *,
                 owns_client: bool = False) -> None:
        self.client = client
        base = client.prefix
        self.ns = namespace if namespace is not None else base + b"kv/"
        meta = base + b"kvmeta/"
        self._fence = meta + b"fence"
        self._intent = meta + b"intent"
        self._data = meta + b"intent-data/"
        self._owns = owns_client
        self._token = uuid.uuid4().hex[:16]
        self._seq = 0
        self._fence_rev = 0
        self._lock = threading.Lock()       # one write at a time (the fence state)
        self._takeover()
        self._recover()

    @classmethod
    def open(cls, url: str, *, compact: bool = True) -> "EtcdKV":
        client = EtcdClient.from_url(url)
        try:
            kv = cls(client, owns_client=True)
        except BaseException:
            client.close()
            raise
        if compact and parse_url(url).options.get("compact", "1") != "0":
            client.start_compactor()
        return kv

    # -- the fence ---------------------------------------------------------------------------
    def _takeover(self) -> None:
        for _ in range(100):
            cur = self.client.get(self._fence)
            rev = cur.mod_revision if cur else 0
            stamp = self._stamp()
            res = self.client.txn([Compare.mod_revision(self._fence, rev)], [Put(self._fence, stamp)])
            if res.succeeded:
                self._fence_rev = res.revision
                return
            now = self.client.get(self._fence)
            if now is not None and now.value == stamp:
                self._fence_rev = now.mod_revision
                return
        raise MetaError(f"etcd KV at {self.ns!r}: could not take over the fence (openers racing)")

    def _stamp(self) -> bytes:
        self._seq += 1
        return f"{self._token}:{self._seq}".encode()

    def _fenced(self, compares: list[Compare], ops: list[Op]) -> None:
        """One txn guarded by the fence (and ``compares``), exactly once (module docstring)."""
        stamp = self._stamp()
        res = self.client.txn([Compare.mod_revision(self._fence, self._fence_rev), *compares],
                              [*ops, Put(self._fence, stamp)])
        if res.succeeded:
            self._fence_rev = res.revision
            return
        cur = self.client.get(self._fence)
        if cur is not None and cur.value == stamp:          # our lost-reply attempt applied
            self._fence_rev = cur.mod_revision
            return
        if cur is None or cur.mod_revision != self._fence_rev:
            raise MetaError(f"etcd KV at {self.ns!r}: another writer opened it (fenced off; "
                            "this write may or may not have applied)")
        raise MetaError(f"etcd KV at {self.ns!r}: a guard of the write failed ({compares})")

    # -- intents -----------------------------------------------------------------------------
    def _data_key(self, intent_id: bytes, i: int) -> bytes:
        return self._data + intent_id + b"/" + struct.pack(">I", i)

    def _apply_intent(self, rec: KeyValue) -> None:
        """Apply every chunk of the intent ``rec`` (guarded: stops if it is gone)."""
        meta = msgpack.unpackb(rec.value)
        intent_id, n = meta["id"], meta["chunks"]
        guard = Compare.mod_revision(self._intent, rec.mod_revision)
        for i in range(n):
            kv = self.client.get(self._data_key(intent_id, i))
            if kv is None:
                if self.client.get(self._intent) is None:
                    return              # finished by someone else meanwhile
                raise MetaError(f"etcd KV at {self.ns!r}: intent {intent_id!r} lost chunk {i}")
            ops = self._ops(msgpack.unpackb(kv.value))
            res = self.client.txn([guard], ops)
            if not res.succeeded:
                return                  # the intent is gone: finished by someone else
            self._hook("applied-chunk")

    def _ops(self, pairs: list) -> list[Op]:
        return [Delete(self.ns + k) if v is None else Put(self.ns + k, v) for k, v in pairs]

    def _hook(self, stage: str) -> None:
        """A seam for crash tests (kill the writer at ``stage``)."""

    def _recover(self) -> None:
        """At open (we hold the fence): finish an intent, drop orphan chunk records."""
        rec = self.client.get(self._intent)
        with self._lock:
            if rec is not None:
                self._apply_intent(rec)
                meta = msgpack.unpackb(rec.value)
                self._fenced([Compare.mod_revision(self._intent, rec.mod_revision)],
                             [Delete(self._intent), Delete.prefix(self._data + meta["id"] + b"/")])
            if next(self.client.range_prefix(self._data, page=1, keys_only=True), None):
                self._fenced([Compare.absent(self._intent)], [Delete.prefix(self._data)])

    # -- the KV seam -------------------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        for _ in range(10):
            res = self.client.txn([], [Range(self.ns + key), Range(self._intent)])
            rows, intent = res.responses
            if not intent:
                return rows[0].value if rows else None
            self._apply_intent(intent[0])
            res = self.client.txn([], [Range(self.ns + key), Range(self._intent)])
            rows, again = res.responses
            if again and again[0].mod_revision == intent[0].mod_revision:
                return rows[0].value if rows else None     # applied whole, not yet cleaned
        raise MetaError(f"etcd KV at {self.ns!r}: intents keep coming (get)")

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Pairs under ``prefix`` in key order, paginated, all pages at one revision."""
        start, end, n = self.ns + prefix, prefix_end(self.ns + prefix), len(self.ns)
        page = 500
        for _ in range(20):
            try:
                res = self.client.txn([], [Range(start, end, limit=page), Range(self._intent)])
            except EtcdError as e:      # over the gRPC message limit (big values): smaller pages
                if e.code == "RESOURCE_EXHAUSTED" and page > 1:
                    page //= 2
                    continue
                raise
            rows, intent = res.responses
            if intent:
                self._apply_intent(intent[0])
                res = self.client.txn([], [Range(start, end, limit=page), Range(self._intent)])
                rows, again = res.responses
                if not again or again[0].mod_revision != intent[0].mod_revision:
                    continue            # finished meanwhile (or a new one): read again
            break
        else:
            raise MetaError(f"etcd KV at {self.ns!r}: intents keep coming (scan)")
        assert rows is not None
        for kv in rows:
            yield kv.key[n:], kv.value
        if len(rows) == page:
            for kv in self.client.range_from(rows[-1].key + b"\x00", end, revision=res.revision,
                                             page=page):
                yield kv.key[n:], kv.value

    def write(self, puts: dict[bytes, bytes], deletes: list[bytes] | tuple = (),
              sync: bool = False) -> None:
        """Deletes then puts, atomically, whatever the size; ``sync`` is always true here."""
        ops: dict[bytes, bytes | None] = {k: None for k in deletes}
        ops.update((k, bytes(v)) for k, v in puts.items())
        if not ops:
            return
        size = 0
        for k, v in ops.items():
            one = len(self.ns) + len(k) + len(v or b"") + _OP_OVERHEAD
            if one > TXN_BYTES:
                raise MetaError(f"etcd KV: a value of {len(v or b'')} bytes (key {k[:40]!r}) is "
                                f"over the {TXN_BYTES}-byte limit of one etcd request")
            size += one
        with self._lock:
            if len(ops) <= TXN_OPS and size <= TXN_BYTES:
                self._fenced([], self._ops(list(ops.items())))
            else:
                self._write_big(list(ops.items()))

    def _write_big(self, pairs: list[tuple[bytes, bytes | None]]) -> None:
        chunks: list[list[tuple[bytes, bytes | None]]] = [[]]
        size = 0
        for k, v in pairs:
            one = len(self.ns) + len(k) + len(v or b"") + _OP_OVERHEAD
            if len(chunks[-1]) >= TXN_OPS or size + one > TXN_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append((k, v))
            size += one
        intent_id = f"{self._token}-{self._seq + 1}".encode()
        for i, ch in enumerate(chunks):         # 1: the chunk records (idempotent puts)
            self.client.put(self._data_key(intent_id, i), msgpack.packb([list(p) for p in ch]))
        self._hook("chunks-written")
        # 2: the commit point
        self._fenced([Compare.absent(self._intent)],
                     [Put(self._intent, msgpack.packb({"id": intent_id, "chunks": len(chunks)}))])
        self._hook("intent-committed")
        rec = self.client.get(self._intent)
        if rec is None:
            raise MetaError(f"etcd KV at {self.ns!r}: the intent vanished (another writer?)")
        self._apply_intent(rec)                 # 3
        self._hook("applied")
        self._fenced([Compare.mod_revision(self._intent, rec.mod_revision)],   # 4
                     [Delete(self._intent), Delete.prefix(self._data + intent_id + b"/")])

    def close(self) -> None:
        if self._owns:
            self.client.close()
