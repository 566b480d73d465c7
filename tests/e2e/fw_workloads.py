"""Real checkpoint workloads, unmodified library calls, run in a subprocess.

    python -m tests.e2e.fw_workloads KIND ROOT [--phase P] [--events FILE] [--tag T]

runs KIND with ROOT as the working directory and only relative paths, so a run
on a plain local directory and one on the acache mount produce the same bytes
wherever a format embeds its own path.  Every workload checks what it reads back
itself (exit status 1 and a message on a mismatch).  ``--events FILE`` appends
one line per step (``save <what>``, ``rmtree <path>``, ``done``, each after
its time) to a file
outside the mount, for the crash tests: they time their kill -9 from it and
exclude checkpoints the workload itself was deleting.

Kinds: torch_save (phases a, b, c), safetensors, dcp (2 ranks, gloo), sharded
(Megatron + DeepSpeed trackers, 2 ranks), hf (Trainer with save_total_limit,
then resume), hf_staging (tmp-checkpoint-N renamed to checkpoint-N).
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import time

WORLD = 2                         # ranks of the distributed workloads
HF_REQUIRED = ("config.json", "model.safetensors", "optimizer.pt", "scheduler.pt",
               "rng_state.pth", "training_args.bin")

_events = None


def event(*words) -> None:
    """One line ``<time.time()>\t<words>`` in the events file."""
    if _events is not None:
        with open(_events, "a") as f:
            f.write(f"{time.time():.3f}\t" + " ".join(str(w) for w in words) + "\n")


def fail(msg: str) -> None:
    print(f"workload check failed: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def same(a, b, what: str) -> None:
    """Recursive equality of (nested) state dicts with tensors."""
    import torch
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(a, b)):
            fail(f"{what}: tensors differ")
    elif isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            fail(f"{what}: keys differ: {sorted(a)[:5]} vs {sorted(b)[:5] if isinstance(b, dict) else b}")
        for k in a:
            same(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            fail(f"{what}: lengths differ")
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{what}[{i}]")
    elif a != b:
        fail(f"{what}: {a!r} != {b!r}")


def state(seed: int, mib: int, n: int = 8) -> dict:
    """A model-like state dict of about ``mib`` MiB of float32 in ``n`` tensors."""
    import torch
    g = torch.Generator().manual_seed(seed)
    per = mib * (1 << 20) // 4 // n
    sd = {f"layers.{i}.weight": torch.randn(per // 256, 256, generator=g) for i in range(n)}
    sd["step"] = seed
    sd["embed.bias"] = torch.arange(1000, dtype=torch.int64) + seed
    return sd


# -- torch.save / torch.load --------------------------------------------------------------
TS_MIB = 80


def torch_save(phase: str) -> None:
    import torch
    if phase == "a":      # save, load (also mmap), overwrite in place before it persisted
        sd = state(0, TS_MIB)
        event("save", "model.pt")
        torch.save(sd, "model.pt")
        same(sd, torch.load("model.pt"), "load")
        same(sd, torch.load("model.pt", mmap=True), "load mmap")
        torch.save({"lr": 0.1, "m": torch.ones(1000)}, "optim.pt")
        sd = state(1, TS_MIB)
        event("save", "model.pt")
        torch.save(sd, "model.pt")                # O_TRUNC over the unpersisted first one
        same(sd, torch.load("model.pt", mmap=True, weights_only=True), "load mmap after overwrite")
    elif phase == "b":    # overwrite in place after it was persisted
        same(state(1, TS_MIB), torch.load("model.pt", mmap=True), "load persisted")
        sd = state(2, TS_MIB)
        event("save", "model.pt")
        torch.save(sd, "model.pt")
        same(sd, torch.load("model.pt", mmap=True), "load mmap after overwrite of persisted")
    elif phase == "c":    # read back only (read-through from the under-storage)
        same(state(2, TS_MIB), torch.load("model.pt", mmap=True), "load mmap read-through")
        same({"lr": 0.1, "m": torch.ones(1000)}, torch.load("optim.pt"), "load read-through")
    else:
        fail(f"unknown phase {phase}")


# -- safetensors ----------------------------------------------------------------------------
def safetensors_wl() -> None:
    import json
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    sd = {k: v for k, v in state(3, 32).items() if isinstance(v, torch.Tensor)}
    event("save", "model.safetensors")
    save_file(sd, "model.safetensors", metadata={"format": "pt"})
    same(sd, load_file("model.safetensors"), "load_file")
    with safe_open("model.safetensors", framework="pt") as f:     # mmap
        for k in f.keys():
            same(sd[k], f.get_tensor(k), f"safe_open {k}")
        sl = f.get_slice("layers.3.weight")[5:9]
        same(sd["layers.3.weight"][5:9], sl, "get_slice")
    # an HF-style sharded save with its index, then overwrite one shard
    names = sorted(sd)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())},
             "weight_map": {}}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:]), 1):
        fn = f"sharded/model-{i:05d}-of-00002.safetensors"
        os.makedirs("sharded", exist_ok=True)
        save_file({k: sd[k] for k in part}, fn, metadata={"format": "pt"})
        index["weight_map"].update({k: os.path.basename(fn) for k in part})
    with open("sharded/model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    sd2 = {k: v * 2 for k, v in sd.items()}
    event("save", "model.safetensors")
    save_file(sd2, "model.safetensors", metadata={"format": "pt"})   # temp + rename onto it
    same(sd2, load_file("model.safetensors"), "load_file after overwrite")
    with open("sharded/model.safetensors.index.json") as f:
        wm = json.load(f)["weight_map"]
    for k, fn in wm.items():
        with safe_open(f"sharded/{fn}", framework="pt") as f:
            same(sd[k], f.get_tensor(k), f"sharded {k}")


# -- distributed helpers ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, *args) -> None:
    import torch.multiprocessing as mp
    port = free_port()
    mp.start_processes(fn, args=(port, *args), nprocs=WORLD, start_method="fork", join=True)


def init_pg(rank: int, port: int) -> None:
    import torch.distributed as dist
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)


# -- PyTorch Distributed Checkpoint ---------------------------------------------------------
DCP_MIB = 16     # per rank


def _dcp_state(mesh, seed: int) -> dict:
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    full = state(seed, DCP_MIB * WORLD, n=4)
    model = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()
             if k.startswith("layers.")}
    model["embed.bias"] = distribute_tensor(full["embed.bias"], mesh, [Replicate()])
    return {"model": model, "extra": {"step": seed, "lr": 0.5 * seed},
            "rank_local": torch.full((1000,), float(seed))}


def _zeros_like(sd):
    import torch
    from torch.distributed.tensor import DTensor
    if isinstance(sd, dict):
        return {k: _zeros_like(v) for k, v in sd.items()}
    if isinstance(sd, DTensor):
        return DTensor.from_local(torch.zeros_like(sd.to_local()), sd.device_mesh, sd.placements)
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    return None


def _dcp_same(a, b, what):
    from torch.distributed.tensor import DTensor
    if isinstance(a, dict):
        for k in a:
            _dcp_same(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, DTensor):
        same(a.to_local(), b.to_local(), what)
    else:
        same(a, b, what)


def _dcp_rank(rank: int, port: int, phase: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    init_pg(rank, port)
    mesh = init_device_mesh("cpu", (WORLD,))
    try:
        steps = [("ckpt/step1", 1, "save"), ("ckpt/step1", 2, "save"), ("ckpt/step2", 3, "async")]
        if phase == "crash":
            steps = [(f"ckpt/step{i}", i, "async" if i == 3 else "save") for i in (1, 2, 3)]
        for path, seed, how in steps:
            sd = _dcp_state(mesh, seed)
            if rank == 0:
                event("save", path)
            if how == "async":
                dcp.async_save(sd, checkpoint_id=path).result()
            else:
                dcp.save(sd, checkpoint_id=path)
            dist.barrier()
            fresh = _zeros_like(sd)
            fresh["extra"] = {"step": 0, "lr": 0.0}
            dcp.load(fresh, checkpoint_id=path)
            _dcp_same(sd, fresh, f"dcp {path} seed {seed}")
            dist.barrier()
    finally:
        dist.destroy_process_group()


def dcp_wl(phase: str) -> None:
    spawn(_dcp_rank, phase)


# -- Megatron / DeepSpeed: per-rank shards, then a tracker file -----------------------------
SHARD_MIB = 8


def _sharded_rank(rank: int, port: int, iters: list[int]) -> None:
    import torch
    import torch.distributed as dist
    init_pg(rank, port)
    try:
        for it in iters:
            if rank == 0:
                event("save", f"iter {it}")
            # Megatron-LM: iter_0000010/mp_rank_0R/model_optim_rng.pt, then the tracker
            d = f"megatron/iter_{it:07d}/mp_rank_{rank:02d}"
            os.makedirs(d, exist_ok=True)
            torch.save({"model": state(it * 10 + rank, SHARD_MIB), "iteration": it},
                       f"{d}/model_optim_rng.pt")
            dist.barrier()
            if rank == 0:
                with open("megatron/latest_checkpointed_iteration.txt", "w") as f:
                    f.write(str(it))
            dist.barrier()
            # DeepSpeed: global_stepN/{mp_rank_00_model_states,zero_pp_rank_R_...}.pt, then `latest`
            d = f"deepspeed/global_step{it}"
            os.makedirs(d, exist_ok=True)
            if rank == 0:
                torch.save({"module": state(it, SHARD_MIB // 2)}, f"{d}/mp_rank_00_model_states.pt")
            torch.save({"optimizer_state_dict": state(it * 100 + rank, SHARD_MIB)},
                       f"{d}/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
            dist.barrier()
            if rank == 0:
                with open("deepspeed/latest", "w") as f:
                    f.write(f"global_step{it}")
            dist.barrier()
        # resume the way both do: read the tracker, load this rank's shard
        with open("megatron/latest_checkpointed_iteration.txt") as f:
            it = int(f.read().strip())
        got = torch.load(f"megatron/iter_{it:07d}/mp_rank_{rank:02d}/model_optim_rng.pt", mmap=True)
        same(state(it * 10 + rank, SHARD_MIB), got["model"], "megatron resume")
        with open("deepspeed/latest") as f:
            tag = f.read().strip()
        got = torch.load(f"deepspeed/{tag}/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        same(state(int(tag.removeprefix("global_step")) * 100 + rank, SHARD_MIB),
             got["optimizer_state_dict"], "deepspeed resume")
    finally:
        dist.destroy_process_group()


def sharded_wl(phase: str) -> None:
    spawn(_sharded_rank, [10, 20] if phase != "crash" else [10, 20, 30])


# -- Hugging Face Trainer ------------------------------------------------------------------------
def _hf_setup():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=4000, n_positions=64)
    model = GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (64, 32), generator=g)
    data = [{"input_ids": x, "labels": x} for x in ids]

    class Spread(TrainerCallback):
        """Saves over 0.5 s apart, so the 3 checkpoints rotation sorts span over 1 s
        and it really sorts by directory mtime (transformers falls back to step
        numbers when all mtimes are within 1 s)."""

        def on_save(self, args, state, control, **kw):
            event("saved", f"checkpoint-{state.global_step}")
            time.sleep(0.55)

    return model, data, Spread()


def _hf_args(max_steps: int, **kw):
    from transformers import TrainingArguments
    return TrainingArguments(output_dir="out", max_steps=max_steps, save_steps=2,
                             save_total_limit=2, per_device_train_batch_size=8, logging_steps=1,
                             report_to=[], seed=0, data_seed=0, use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True, **kw)


def _trainer_cls(staging: bool):
    from transformers import Trainer
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
    if not staging:
        return Trainer

    class StagingTrainer(Trainer):
        """The pattern of transformers 4.36 and several trainers: populate
        tmp-checkpoint-N, rename it to checkpoint-N, fsync it, then rotate."""

        def _save_checkpoint(self, model, trial):
            run_dir = self._get_output_dir(trial=trial)
            final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            staging_dir = os.path.join(run_dir, f"tmp-{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            self.store_flos()
            self.save_model(staging_dir, _internal_call=True)
            self._save_optimizer_and_scheduler(staging_dir)
            self._save_scaler(staging_dir)
            self._save_rng_state(staging_dir)
            self.state.save_to_json(os.path.join(staging_dir, "trainer_state.json"))
            if not os.path.exists(final):
                os.rename(staging_dir, final)
            fd = os.open(final, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               use_mtime=True)
    return StagingTrainer


def hf_wl(phase: str, staging: bool) -> None:
    import torch
    from transformers.trainer_utils import get_last_checkpoint
    real_rmtree = shutil.rmtree

    def logged_rmtree(path, *a, **kw):
        event("rmtree", os.path.relpath(path))
        states = {}      # on an acache mount: how far persisting got when it is deleted
        for dirpath, _, files in os.walk(path):
            for fn in files:
                try:
                    st = os.getxattr(os.path.join(dirpath, fn), "user.acache.state").decode()
                except OSError:
                    continue
                states[st] = states.get(st, 0) + 1
        if states:
            event("states", os.path.relpath(path), *(f"{k}={v}" for k, v in sorted(states.items())))
        return real_rmtree(path, *a, **kw)
    shutil.rmtree = logged_rmtree

    torch.set_num_threads(1)
    cls = _trainer_cls(staging)
    model, data, spread = _hf_setup()
    event("save", "train")
    cls(model=model, args=_hf_args(6 if phase != "crash" else 10), train_dataset=data,
        callbacks=[spread]).train()
    kept = sorted(n for n in os.listdir("out") if n.startswith("checkpoint-"))
    if phase != "crash" and kept != ["checkpoint-4", "checkpoint-6"]:
        fail(f"rotation kept {kept}, not the two newest")
    mtimes = [os.path.getmtime(f"out/{k}") for k in sorted(kept, key=lambda k: int(k.split("-")[1]))]
    if mtimes != sorted(mtimes):
        fail(f"checkpoint directory mtimes are not in save order: {list(zip(kept, mtimes))}")
    if phase == "crash":
        return
    last = get_last_checkpoint("out")
    # resume in a fresh model/trainer, as a restarted job does
    model, data, spread = _hf_setup()
    t = cls(model=model, args=_hf_args(8), train_dataset=data, callbacks=[spread])
    t.train(resume_from_checkpoint=last)
    if t.state.global_step != 8:
        fail(f"resumed run ended at step {t.state.global_step}")
    kept = sorted(n for n in os.listdir("out") if n.startswith("checkpoint-"))
    if kept != ["checkpoint-6", "checkpoint-8"]:
        fail(f"rotation after resume kept {kept}")
    if staging and any(n.startswith("tmp-") for n in os.listdir("out")):
        fail("a tmp-checkpoint directory was left behind")


def main(argv=None) -> None:
    global _events
    ap = argparse.ArgumentParser()
    ap.add_argument("kind")
    ap.add_argument("root")
    ap.add_argument("--phase", default="a")
    ap.add_argument("--events")
    a = ap.parse_args(argv)
    _events = os.path.abspath(a.events) if a.events else None
    os.chdir(a.root)
    if a.kind == "torch_save":
        torch_save(a.phase)
    elif a.kind == "safetensors":
        safetensors_wl()
    elif a.kind == "dcp":
        dcp_wl(a.phase)
    elif a.kind == "sharded":
        sharded_wl(a.phase)
    elif a.kind in ("hf", "hf_staging"):
        hf_wl(a.phase, a.kind == "hf_staging")
    else:
        fail(f"unknown workload {a.kind}")
    event("done")


if __name__ == "__main__":
    main()
