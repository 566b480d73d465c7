"""FUSE operations by kind, with a latency histogram: cheap enough for every request.

Each thread that answers requests gets its own ``Shard`` (plain lists, no lock): the
native engine one per reader thread, pyfuse3 one for its trio thread.  Recording is two
list increments and a bisect over 19 bounds; summing the shards happens at scrape time
(acache.node.metrics), where reading lists another thread updates is good enough for a
monotonic counter (a scrape may miss the request in flight).
"""
from __future__ import annotations

import threading
from bisect import bisect_left

# upper bounds of the histogram buckets, in seconds (the last bucket is +Inf)
BOUNDS = (10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
          50e-3, 100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0)
_BOUNDS_NS = tuple(int(b * 1e9) for b in BOUNDS)
NOPS = 64


class Shard:
    __slots__ = ("buckets", "sums")

    def __init__(self) -> None:
        # buckets[op][i]: requests of op whose latency fell in bucket i (not cumulative)
        self.buckets = [[0] * (len(BOUNDS) + 1) for _ in range(NOPS)]
        self.sums = [0] * NOPS             # nanoseconds, per op

    def record(self, op: int, ns: int) -> None:
        self.buckets[op][bisect_left(_BOUNDS_NS, ns)] += 1
        self.sums[op] += ns


class OpStats:
    """Operation kinds are small integers (the FUSE opcode); ``names`` maps them to the
    label value (lower case: lookup, getattr, write, ...)."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        self._shards: list[Shard] = []
        self._lock = threading.Lock()

    def shard(self) -> Shard:
        s = Shard()
        with self._lock:
            self._shards.append(s)
        return s

    def snapshot(self) -> dict[str, tuple[list[int], int]]:
        """op name -> (bucket counts, not cumulative; total ns), over every shard."""
        with self._lock:
            shards = list(self._shards)
        out: dict[str, tuple[list[int], int]] = {}
        for op in range(NOPS):
            counts = [0] * (len(BOUNDS) + 1)
            total = 0
            for s in shards:
                b = s.buckets[op]
                if any(b):
                    counts = [x + y for x, y in zip(counts, b)]
                    total += s.sums[op]
            if any(counts):
                name = self.names.get(op, str(op))
                if name in out:    # two opcodes under one name: add them up
                    prev, ptotal = out[name]
                    counts, total = [x + y for x, y in zip(prev, counts)], total + ptotal
                out[name] = (counts, total)
        return out
