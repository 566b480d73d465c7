"""The cost of the FUSE request histogram on the hot path (acache.fs.opstats): what a
native reader thread adds per request (two clock reads and Shard.record), and what the
pyfuse3 wrapper adds per handler call (one more coroutine frame plus the same), each
against the same loop without it.  python -m bench.opstats"""
from __future__ import annotations

import time

import trio

from acache.fs.opstats import OpStats

N = 500_000


def native(n: int = N) -> tuple[float, float]:
    record = OpStats({}).shard().record
    clock = time.perf_counter_ns

    def dispatch() -> None:
        pass
    t0 = time.perf_counter()
    for _ in range(n):
        dispatch()
    base = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(n):
        s = clock()
        dispatch()
        record(15, clock() - s)
    return base / n, (time.perf_counter() - t0) / n


def pyfuse3_wrapper(n: int = N // 5) -> tuple[float, float]:
    from acache.fs.pyfuse3_engine import _timed

    class Ops:
        def __init__(self) -> None:
            self._record = OpStats({}).shard().record

        async def getattr(self, ino):
            return ino
    plain = Ops()
    timed = Ops()
    wrapped = _timed(2, Ops.getattr)

    async def run() -> tuple[float, float]:
        t0 = time.perf_counter()
        for i in range(n):
            await plain.getattr(i)
        base = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(n):
            await wrapped(timed, i)
        return base / n, (time.perf_counter() - t0) / n
    return trio.run(run)


def main() -> None:
    for name, (base, with_stats) in (("native reader loop", native()),
                                     ("pyfuse3 handler", pyfuse3_wrapper())):
        print(f"{name:20s} without {base * 1e9:7.0f} ns   with {with_stats * 1e9:7.0f} ns   "
              f"cost {(with_stats - base) * 1e9:6.0f} ns per request")


if __name__ == "__main__":
    main()
