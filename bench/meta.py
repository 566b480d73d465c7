"""Case 6: metadata speed. One process does each operation on ``n`` files, one phase after
the other, and times each phase: ops/s per operation. The files are spread over directories
of ``per_dir`` (1,000: the shape of a checkpoint, one directory per save).

    create   open(O_CREAT|O_WRONLY|O_TRUNC) + write 4 KiB + close
    stat     os.stat of every file
    rename   every file to a new name in the same directory
    utime    os.utime of every file (explicit times)
    readdir  os.listdir of every directory, 5 times (each name listed counts as one op)
    unlink   every file

Runnable alone: ``python -m bench.meta DIR [N]`` prints the ops/s as JSON."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

OPS = ("create", "stat", "rename", "utime", "readdir", "unlink")
LABELS = {"create": "create + write 4 KiB + close", "stat": "stat", "rename": "rename",
          "utime": "utime", "readdir": "readdir (per name)", "unlink": "unlink"}
BLOCK = b"\xa5" * 4096
READDIR_ROUNDS = 5     # listings of the whole directory (one is too short to time)


def run_meta(d: Path, n: int, per_dir: int = 1000, log=None) -> dict[str, float]:
    """ops/s of each operation on ``n`` files under the (new) directory ``d``."""
    dirs = [d / f"d{j:03d}" for j in range((n + per_dir - 1) // per_dir)]
    for sub in dirs:
        sub.mkdir(parents=True, exist_ok=True)
    a = [os.path.join(dirs[i // per_dir], f"f{i:06d}") for i in range(n)]
    b = [os.path.join(dirs[i // per_dir], f"g{i:06d}") for i in range(n)]
    out: dict[str, float] = {}

    def timed(op: str, count: int, fn) -> None:
        t0 = time.perf_counter()
        fn()
        out[op] = count / (time.perf_counter() - t0)
        if log is not None:
            log(op, out[op])

    def create() -> None:
        flags = os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC
        for p in a:
            fd = os.open(p, flags, 0o644)
            os.write(fd, BLOCK)
            os.close(fd)

    def stat() -> None:
        for p in a:
            os.stat(p)

    def rename() -> None:
        for src, dst in zip(a, b):
            os.rename(src, dst)

    def utime() -> None:
        t = (1_700_000_000_000_000_000, 1_700_000_000_000_000_000)
        for p in b:
            os.utime(p, ns=t)

    def readdir() -> None:
        for _ in range(READDIR_ROUNDS):
            if sum(len(os.listdir(sub)) for sub in dirs) != n:
                raise RuntimeError(f"readdir under {d} did not list {n} names")

    def unlink() -> None:
        for p in b:
            os.unlink(p)

    timed("create", n, create)
    timed("stat", n, stat)
    timed("rename", n, rename)
    timed("utime", n, utime)
    timed("readdir", n * READDIR_ROUNDS, readdir)
    timed("unlink", n, unlink)
    for sub in dirs:
        os.rmdir(sub)
    return out


if __name__ == "__main__":
    print(json.dumps(run_meta(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 10000,
                              log=lambda op, v: print(f"{op}: {v:,.0f} ops/s", file=sys.stderr))))
