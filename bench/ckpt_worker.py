"""A training-style process for the checkpoint-stall case (case 3).

    python -m bench.ckpt_worker --kind save --bytes N
    python -m bench.ckpt_worker --kind dcp --bytes N --rank R --world W --port P

It builds a model-like state dict once (``--bytes`` in total; with DCP each rank holds its
shard of every weight as a DTensor), prints ``BENCH {"ready": ...}``, then reads one JSON
command per line on stdin and answers each with ``BENCH {"seconds": ...}``:

    {"path": "/some/dir/ckpt-3"}     torch.save to <path>.pt / dcp.save into directory <path>
    {"s3": "direct/ckpt-3"}          straight to the S3 server: torch.save into memory and a
                                     minio upload; DCP through a minio-backed DCP filesystem
    {"quit": true}

The time is measured around the save call only (for DCP after a barrier, so it is the
collective's duration); the orchestrator takes the slowest rank.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from contextlib import contextmanager

MiB = 1 << 20
PART = 16 * MiB          # the same part size and parallelism as acache's s3:// defaults
PARALLEL = 8


def _say(**kw) -> None:
    print("BENCH " + json.dumps(kw), flush=True)


# -- direct S3 ------------------------------------------------------------------------------------
def _minio():
    from minio import Minio
    e = os.environ
    return Minio(e["BENCH_S3_ENDPOINT"], access_key=e["BENCH_S3_ACCESS_KEY"],
                 secret_key=e["BENCH_S3_SECRET_KEY"], secure=False, region=e["BENCH_S3_REGION"])


def _bucket() -> str:
    return os.environ["BENCH_S3_BUCKET"]


def _put(client, key: str, stream, length: int) -> None:
    client.put_object(_bucket(), key, stream, length, part_size=PART, num_parallel_uploads=PARALLEL)


def _s3_filesystem_writer(prefix: str):
    """A DCP FileSystemWriter whose files are S3 objects (what FsspecWriter does with s3fs,
    on the minio SDK): each stream is buffered in memory and uploaded when DCP closes it."""
    from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemWriter
    from minio.commonconfig import CopySource
    client = _minio()

    class _Upload(io.BytesIO):
        def __init__(self, key: str) -> None:
            super().__init__()
            self.key = key

        def close(self) -> None:
            if not self.closed:
                n = self.tell()
                self.seek(0)
                _put(client, self.key, self, n)
            super().close()

    class MinioFS(FileSystemBase):
        @contextmanager
        def create_stream(self, path, mode):
            if "w" not in mode:
                raise NotImplementedError("the bench only writes")
            s = _Upload(str(path))
            try:
                yield s
            finally:
                s.close()

        def concat_path(self, path, suffix):
            return f"{path}/{suffix}"

        def rename(self, path, new_path):
            client.copy_object(_bucket(), str(new_path), CopySource(_bucket(), str(path)))
            client.remove_object(_bucket(), str(path))

        def init_path(self, path):
            return str(path)

        def mkdir(self, path):
            pass

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id):
            return True

        def exists(self, path):
            from minio.error import S3Error
            try:
                client.stat_object(_bucket(), str(path))
                return True
            except S3Error:
                return False

        def rm_file(self, path):
            client.remove_object(_bucket(), str(path))

    w = FileSystemWriter(prefix, sync_files=False)   # an S3 PUT is durable when it returns
    w.fs = MinioFS()
    w.path = prefix
    return w


# -- the state dict --------------------------------------------------------------------------------
def build_state(total: int, rank: int, world: int, dcp: bool):
    import torch
    cols = 1024
    tensor_bytes = max(4 * cols * world, min(64 * MiB, total // 8))
    rows = max(world, tensor_bytes // (4 * cols) // world * world)
    n = max(1, total // (rows * cols * 4))
    mesh = None
    if dcp:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    model = {}
    for i in range(n):
        local = torch.empty(rows // world if dcp else rows, cols).uniform_(-1, 1, generator=g)
        if dcp:
            from torch.distributed.tensor import DTensor, Shard
            local = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                       shape=(rows, cols), stride=(cols, 1))
        model[f"layers.{i}.weight"] = local
        model[f"layers.{i}.bias"] = torch.zeros(cols)
    return {"model": model, "step": 1000, "lr": 3e-4}


# -- saving ------------------------------------------------------------------------------------------
def save_once(cmd: dict, state, kind: str) -> float:
    import torch
    if kind == "save":
        if "s3" in cmd:
            client = _minio()
            t0 = time.perf_counter()
            buf = io.BytesIO()
            torch.save(state, buf)
            n = buf.tell()
            buf.seek(0)
            _put(client, cmd["s3"] + ".pt", buf, n)
            return time.perf_counter() - t0
        t0 = time.perf_counter()
        torch.save(state, cmd["path"] + ".pt")
        return time.perf_counter() - t0
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    writer = (_s3_filesystem_writer(cmd["s3"]) if "s3" in cmd
              else dcp.FileSystemWriter(cmd["path"]))
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=writer)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=["save", "dcp"], required=True)
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    if a.kind == "dcp":
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}",
                                rank=a.rank, world_size=a.world)
    state = build_state(a.bytes, a.rank, a.world, a.kind == "dcp")
    _say(ready=True, pid=os.getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        try:
            _say(seconds=save_once(cmd, state, a.kind))
        except Exception as e:
            _say(error=f"{type(e).__name__}: {e}")
    if a.kind == "dcp":
        import torch.distributed as dist
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
