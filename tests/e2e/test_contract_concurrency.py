"""Several processes at once on one mount: DCP-like saves (one directory per rank,
temp + rename, a marker last) while other processes delete old steps and read
read-through files.  No EIO anywhere; the under-storage ends up as the namespace."""
from __future__ import annotations

import multiprocessing
import os
import random
import shutil

from tests.e2e.contract_util import pattern, ufs_real

STEPS, RANKS = 3, 6


def _rank(root: str, rank: int, barrier, q) -> None:
    try:
        for step in range(STEPS):
            d = os.path.join(root, f"step-{step}")
            os.makedirs(d, exist_ok=True)
            data = pattern(200_000 + rank * 1000 + step, rank * 10 + step)
            tmp = os.path.join(d, f".__{rank}_0.distcp.tmp")
            with open(tmp, "wb") as f:
                for off in range(0, len(data), 65536):
                    f.write(data[off:off + 65536])
                os.fsync(f.fileno())
            os.rename(tmp, os.path.join(d, f"__{rank}_0.distcp"))
            with open(os.path.join(d, f"__{rank}_0.distcp"), "rb") as f:
                assert f.read() == data
            barrier.wait()          # every rank has saved this step
            if step >= 1 and rank == 0:
                shutil.rmtree(os.path.join(root, f"step-{step - 1}"))
        q.put((rank, None))
    except BaseException as e:   # noqa: BLE001 - reported to the test
        q.put((rank, repr(e)))


def _reader(path: str, data_len: int, seed: int, q) -> None:
    try:
        want = pattern(data_len, 77)
        rng = random.Random(seed)
        with open(path, "rb", buffering=0) as f:
            for _ in range(300):
                off = rng.randrange(0, data_len - 8192)
                f.seek(off)
                assert f.read(8192) == want[off:off + 8192], off
        q.put(("reader", None))
    except BaseException as e:   # noqa: BLE001
        q.put(("reader", repr(e)))


def test_parallel_ranks_rotation_and_readers(make_node):
    n = make_node(start=False)
    big = 20 << 20
    (n.ufs_dir / "data").mkdir(parents=True)
    (n.ufs_dir / "data" / "old.bin").write_bytes(pattern(big, 77))
    n.start()
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    root = str(n.mnt / "ckpt")
    os.mkdir(root)
    barrier = ctx.Barrier(RANKS)
    procs = [ctx.Process(target=_rank, args=(root, r, barrier, q)) for r in range(RANKS)]
    procs += [ctx.Process(target=_reader, args=(str(n.mnt / "data" / "old.bin"), big, s, q))
              for s in range(3)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(err is None for _, err in results), results
    assert sorted(os.listdir(root)) == [f"step-{STEPS - 1}"]
    with open(os.path.join(root, f"step-{STEPS - 1}", "_SUCCESS"), "wb"):
        pass
    n.flush()
    ufs = ufs_real(n.ufs_files())
    mount = {}
    for dirpath, _, files in os.walk(n.mnt):
        for f in files:
            p = os.path.join(dirpath, f)
            mount[os.path.relpath(p, n.mnt)] = open(p, "rb").read()
    assert ufs == mount
    last = f"ckpt/step-{STEPS - 1}"
    assert {k for k in ufs if k.startswith(last)} == \
        {f"{last}/__{r}_0.distcp" for r in range(RANKS)} | {f"{last}/_SUCCESS"}
