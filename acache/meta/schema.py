"""The key schema (all keys are bytes; integers big-endian so scans are ordered).

    C<name>                 -> u64        counters: next_ino, next_seq
    I<ino:u64>              -> msgpack    an inode record (Inode.pack)
    D<parent:u64><name>     -> u64 ino    a directory entry
    J<seq:u64>              -> msgpack    a journal entry (Entry.pack), applied to the
                                          under-storage in seq order by the persister
    N<node-id>              -> msgpack    node registry (placement: which host holds data)
    S<seq:u64>              -> msgpack    a journal entry the operator skipped (`acache journal
                                          skip`): op, path, dst, reason, time (a record)
    T<token>                -> b""        a stage token no journal entry holds any more (the
                                          entry was cancelled, or staged again under a new
                                          token): its leftovers are cleaned, at restart too

In a cluster's namespace KV, besides (records of other modules' schemas, written in the
batches of the operations that change them; see those modules):

    W<ino:u64>, O<ino:u64><gen:u64><node>, P<ino:u64><gen:u64><node>
                                          open-file sessions (acache.cluster.sessions)
    Q<node>\0<rid>                        a request's stored reply (acache.cluster.requests)

The namespace (I, D) and the journal (J) change together in one atomic batch.
"""
from __future__ import annotations

import struct

_U64 = struct.Struct(">Q")


def u64(n: int) -> bytes:
    return _U64.pack(n)


def from_u64(b: bytes) -> int:
    return _U64.unpack(b)[0]


def counter_key(name: str) -> bytes:
    return b"C" + name.encode()


def inode_key(ino: int) -> bytes:
    return b"I" + u64(ino)


def dentry_key(parent: int, name: bytes) -> bytes:
    return b"D" + u64(parent) + name


def dentry_prefix(parent: int) -> bytes:
    return b"D" + u64(parent)


def journal_key(seq: int) -> bytes:
    return b"J" + u64(seq)


def skipped_key(seq: int) -> bytes:
    return b"S" + u64(seq)


INODE_PREFIX = b"I"
DENTRY_PREFIX = b"D"
JOURNAL_PREFIX = b"J"
STAGE_PREFIX = b"T"


def stage_key(token: str) -> bytes:
    return STAGE_PREFIX + token.encode("utf-8", "surrogateescape")
