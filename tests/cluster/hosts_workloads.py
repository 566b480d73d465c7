"""Checkpoint workloads for the multi-host tests, one process per host (spawned inside it):

    python -m tests.cluster.hosts_workloads dcp_save ROOT --rank R --master ADDR:PORT
    python -m tests.cluster.hosts_workloads dcp_load ROOT
    python -m tests.cluster.hosts_workloads hf_save ROOT
    python -m tests.cluster.hosts_workloads hf_resume ROOT

``dcp_save``: rank R of 2 (gloo over the host's eth0, rendezvous at ADDR:PORT), two DCP saves
(ckpt/step1, ckpt/step2) of the single-host DCP workload's sharded state
(tests.e2e.fw_workloads._dcp_state), each read back by both ranks.  ``dcp_load``: one process,
no process group, loads both checkpoints resharded into full tensors and checks them against the
state the ranks saved.  ``hf_save``: the HF Trainer workload's first run (6 steps, save every 2,
keep 2); ``hf_resume``: its resume from the last checkpoint to step 8 (rotation deletes one).
Each checks what it reads itself: exit status 1 and a message on a mismatch.
"""
from __future__ import annotations

import argparse
import os

from tests.e2e import fw_workloads as fw

STEPS = (("ckpt/step1", 1), ("ckpt/step2", 2))


def dcp_save(rank: int, master: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank,
                            world_size=fw.WORLD)
    try:
        mesh = init_device_mesh("cpu", (fw.WORLD,))
        for path, seed in STEPS:
            sd = fw._dcp_state(mesh, seed)
            dcp.save(sd, checkpoint_id=path)
            dist.barrier()
            fresh = fw._zeros_like(sd)
            fresh["extra"] = {"step": 0, "lr": 0.0}
            dcp.load(fresh, checkpoint_id=path)
            fw._dcp_same(sd, fresh, f"dcp {path} rank {rank}")
            dist.barrier()
    finally:
        dist.destroy_process_group()


def dcp_load() -> None:
    """The whole checkpoint in one process (an evaluation job on another host)."""
    import torch
    import torch.distributed.checkpoint as dcp
    for path, seed in STEPS:
        full = fw.state(seed, fw.DCP_MIB * fw.WORLD, n=4)
        want = {"model": {k: v for k, v in full.items() if k.startswith("layers.")},
                "extra": {"step": seed, "lr": 0.5 * seed},
                "rank_local": torch.full((1000,), float(seed))}
        want["model"]["embed.bias"] = full["embed.bias"]
        fresh = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
                 "extra": {"step": 0, "lr": 0.0}, "rank_local": torch.zeros(1000)}
        dcp.load(fresh, checkpoint_id=path, no_dist=True)
        fw.same(want, fresh, f"dcp_load {path}")


def hf_save() -> None:
    import torch
    torch.set_num_threads(1)
    model, data, spread = fw._hf_setup()
    fw._trainer_cls(False)(model=model, args=fw._hf_args(6), train_dataset=data,
                           callbacks=[spread]).train()
    kept = sorted(n for n in os.listdir("out") if n.startswith("checkpoint-"))
    if kept != ["checkpoint-4", "checkpoint-6"]:
        fw.fail(f"rotation kept {kept}, not the two newest")


def hf_resume() -> None:
    import torch
    from transformers.trainer_utils import get_last_checkpoint
    torch.set_num_threads(1)
    last = get_last_checkpoint("out")
    if last is None or os.path.basename(last) != "checkpoint-6":
        fw.fail(f"the last checkpoint seen here is {last}, not out/checkpoint-6")
    model, data, spread = fw._hf_setup()
    t = fw._trainer_cls(False)(model=model, args=fw._hf_args(8), train_dataset=data,
                               callbacks=[spread])
    t.train(resume_from_checkpoint=last)
    if t.state.global_step != 8:
        fw.fail(f"resumed run ended at step {t.state.global_step}")
    kept = sorted(n for n in os.listdir("out") if n.startswith("checkpoint-"))
    if kept != ["checkpoint-6", "checkpoint-8"]:
        fw.fail(f"rotation after resume kept {kept}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=("dcp_save", "dcp_load", "hf_save", "hf_resume"))
    ap.add_argument("root")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--master", default="")
    a = ap.parse_args(argv)
    os.chdir(a.root)
    if a.kind == "dcp_save":
        dcp_save(a.rank, a.master)
    elif a.kind == "dcp_load":
        dcp_load()
    elif a.kind == "hf_save":
        hf_save()
    else:
        hf_resume()
    print("OK", flush=True)


if __name__ == "__main__":
    main()
