"""The one-command demonstration: a small real training loop that checkpoints
through an acache mount, next to the same loop saving straight to the
under-storage.

    scripts/demo                          # own node + mount in a temp ACACHE_HOME, a temp directory as under-storage
    scripts/demo --ufs /mnt/nfs/demo      # ... persisting to that directory (NFS, Lustre, ...)
    scripts/demo --ufs s3://bucket/prefix # ... to S3 (credentials: AWS_* / ACACHE_S3_* env)
    scripts/demo --local-s3               # ... to a local S3-protocol server (moto; test extra)
    scripts/demo --home ~/.local/state/acache   # use a running node and its mount instead
    scripts/demo --plot stall.png         # ... and draw the table (the plot extra: matplotlib)

Each run trains the same tiny model (a large embedding table, so its state with
Adam is a few hundred MB) twice from the same seed: once saving every few steps
through the mount, once saving straight to the under-storage.  A save is
``torch.save`` of model + optimizer into ``step-N.pt`` with an fsync, then a
``latest`` tracker, keeping the last two checkpoints, as training scripts do.
"Loop blocked" is the wall time of that save, i.e. how long training stopped.
The fsync makes both durable when the save returns: on the cache tier with
acache (the under-storage follows in the background, in order), in the
under-storage for the straight save.  At the end `acache flush --wait` shows
how long after the last save everything was in the under-storage.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

MiB = 1 << 20
out = Console()


# -- the node ------------------------------------------------------------------------------
class Node:
    """A running node with a mount: our own (temp ACACHE_HOME, torn down at the end)
    or an existing one (``home`` of a node that has a mount)."""

    def __init__(self, root: Path, home: Path | None, ufs: str | None, engine: str | None,
                 env: dict) -> None:
        self.own = home is None
        self.home = Path(home) if home else root / "home"
        self.env = dict(os.environ, ACACHE_HOME=str(self.home), **env)
        self.mnt: Path | None = None
        if self.own:
            self.env["ACACHE_UFS"] = ufs or f"file://{root / 'ufs'}"
            if engine:
                self.env["ACACHE_ENGINE"] = engine
        self.root = root

    def cli(self, *args: str, timeout: float = 120) -> str:
        p = subprocess.run([sys.executable, "-m", "acache.cli", *args], env=self.env,
                           capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise SystemExit(f"demo: `acache {' '.join(args)}` failed: "
                             f"{(p.stderr or p.stdout).strip()}")
        return p.stdout

    def status(self) -> dict:
        from acache.node.client import Client
        with Client(self.home / "acache.sock", timeout=30) as c:
            return c.call("status")

    def start(self) -> dict:
        if self.own:
            mnt = self.root / "mnt"
            mnt.mkdir(parents=True, exist_ok=True)
            self.cli("up")
            self.cli("mount", str(mnt))
        st = self.status()
        if not st.get("mountpoint"):
            raise SystemExit(f"demo: the node at {self.home} has no mount; `acache mount PATH` first")
        self.mnt = Path(st["mountpoint"])
        return st

    def flush(self, path: Path, timeout: float = 3600) -> float:
        from acache.node.client import Client
        t0 = time.perf_counter()
        with Client(self.home / "acache.sock", timeout=30) as c:
            c.flush(str(path), timeout)
        return time.perf_counter() - t0

    def stop(self) -> None:
        if not self.own:
            return
        # everything was flushed already, or we are giving up (Ctrl-C): do not wait for more
        subprocess.run([sys.executable, "-m", "acache.cli", "down", "--no-flush"], env=self.env,
                       capture_output=True, timeout=120)
        if self.mnt is not None and str(self.mnt) in _fuse_mounts():
            subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True)


def _fuse_mounts() -> list[str]:
    with open("/proc/mounts") as f:
        return [ln.split()[1] for ln in f if ln.split()[2].startswith("fuse")]


# -- the under-storage, written straight --------------------------------------------------------
class DirectDir:
    """Saves straight into a directory (NFS, Lustre, a local disk): write + fsync."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def write(self, name: str, save) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / name, "wb") as f:
            save(f)
            f.flush()
            os.fsync(f.fileno())
            n = f.tell()
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return n

    def delete(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class DirectS3:
    """Saves straight to S3: serialize into RAM (/dev/shm), then a parallel
    multipart upload (acache's own S3 client, as fast as it gets)."""

    def __init__(self, url: str, s3_options: dict) -> None:
        from acache.data.under.s3 import S3Store
        self.store = S3Store(url, **s3_options)
        self.tmp = Path(tempfile.mkdtemp(prefix="acache-demo-", dir="/dev/shm"
                                         if os.path.isdir("/dev/shm") else None))
        self.names: set[str] = set()

    def write(self, name: str, save) -> int:
        src = self.tmp / "buf"
        with open(src, "wb") as f:
            save(f)
            n = f.tell()
        token = self.store.new_token(name)
        self.store.stage(name, token, str(src), n).commit()
        src.unlink()
        self.names.add(name)
        return n

    def delete(self, name: str) -> None:
        self.store.delete(name)
        self.names.discard(name)

    def close(self) -> None:
        for name in list(self.names):
            self.delete(name)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.store.close()


class ViaMount(DirectDir):
    """Saves into the acache mount: the same calls as DirectDir."""


# -- the training loop ------------------------------------------------------------------------
def build(state_mb: int, seed: int = 0):
    import torch
    from torch import nn
    torch.manual_seed(seed)
    dim, classes = 256, 512
    params = state_mb * MiB // 12                 # fp32 weights + Adam's two moments
    vocab = max(1000, (params - 9 * dim * dim - dim * classes) // dim)

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim, sparse=True)   # cheap steps, big state
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            self.head = nn.Linear(dim, classes)

        def forward(self, x):
            return self.head(self.mlp(self.emb(x).mean(1)))

    model = TinyLM()
    opts = {"emb": torch.optim.SparseAdam(model.emb.parameters(), lr=1e-3),
            "rest": torch.optim.Adam([p for n, p in model.named_parameters()
                                      if not n.startswith("emb.")], lr=1e-3)}
    g = torch.Generator().manual_seed(seed + 1)
    data = torch.randint(0, vocab, (64, 32, 16), generator=g)      # 64 batches of 32 x 16 tokens
    return model, opts, data, classes


class Sampler:
    """The node's dirty and persisted bytes every 0.2 s, in a thread (for --plot)."""

    def __init__(self, node: "Node") -> None:
        import threading
        self.node, self.t0 = node, time.perf_counter()
        self.samples: list[tuple[float, int, int, int]] = []
        self.marks: list[tuple[float, int]] = []       # (s, step) when a save started
        self._stop = threading.Event()
        st = node.status()
        self._base, self._sent = st["persisted_bytes"], st["uploaded_bytes"]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            st = self.node.status()
            self.samples.append((time.perf_counter() - self.t0, st["dirty_bytes"],
                                 st["persisted_bytes"] - self._base, st["uploaded_bytes"] - self._sent))
            self._stop.wait(0.2)

    def mark(self, step: int) -> None:
        self.marks.append((time.perf_counter() - self.t0, step))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        st = self.node.status()
        self.samples.append((time.perf_counter() - self.t0, st["dirty_bytes"],
                             st["persisted_bytes"] - self._base, st["uploaded_bytes"] - self._sent))


def train(target, state_mb: int, steps: int, every: int, keep: int,
          on_save=None) -> tuple[list, float]:
    """Run the loop, saving to ``target``; [(step, bytes, blocked s, loss)], loop seconds."""
    import torch
    model, opts, data, classes = build(state_mb)
    saves, kept = [], []
    t_loop = time.perf_counter()
    for step in range(1, steps + 1):
        x = data[(step - 1) % len(data)]
        loss = torch.nn.functional.cross_entropy(model(x), x[:, 0] % classes)
        for o in opts.values():
            o.zero_grad()
        loss.backward()
        for o in opts.values():
            o.step()
        if step % every == 0:
            ckpt = {"model": model.state_dict(), "step": step,
                    "optimizer": {k: o.state_dict() for k, o in opts.items()}}
            name = f"step-{step:06d}.pt"
            if on_save is not None:
                on_save(step)
            t0 = time.perf_counter()
            n = target.write(name, lambda f: torch.save(ckpt, f))
            target.write("latest", lambda f: f.write(name.encode()))
            kept.append(name)
            while len(kept) > keep:
                target.delete(kept.pop(0))
            saves.append((step, n, time.perf_counter() - t0, loss.item()))
    return saves, time.perf_counter() - t_loop


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    return h.hexdigest()


def _human(n: float) -> str:
    return f"{n / MiB:.0f} MiB" if n < 10 * 1024 * MiB else f"{n / (1024 * MiB):.1f} GiB"


def report(via, direct, loop_a, loop_d, ufs_label, flush_s, verified, st, same_disk) -> None:
    t = Table(title=f"checkpoint saves: training loop blocked (engine {st['engine']}"
                    f"{', passthrough' if st.get('passthrough') else ''})")
    t.add_column("save", justify="right")
    t.add_column("step", justify="right")
    t.add_column("size", justify="right")
    t.add_column("loss", justify="right")
    t.add_column("via acache", justify="right", style="green")
    t.add_column(f"straight to {ufs_label}", justify="right", style="yellow")
    t.add_column("ratio", justify="right", style="bold")
    for i, ((step, n, ba, loss), (_, _, bd, _)) in enumerate(zip(via, direct), 1):
        t.add_row(str(i), str(step), _human(n), f"{loss:.3f}", f"{ba:.2f} s", f"{bd:.2f} s",
                  f"{bd / ba:.1f}x" if ba > 0 else "-")
    ta, td = sum(s[2] for s in via), sum(s[2] for s in direct)
    t.add_section()
    t.add_row("all", "", _human(sum(s[1] for s in via)), "", f"{ta:.2f} s", f"{td:.2f} s",
              f"{td / ta:.1f}x" if ta > 0 else "-")
    t.add_row("loop", "", "", "", f"{loop_a:.2f} s", f"{loop_d:.2f} s",
              f"{loop_d / loop_a:.1f}x" if loop_a > 0 else "-")
    out.print(t)
    out.print(f"`acache flush --wait` after the last save: everything was in the under-storage "
              f"{flush_s:.2f} s later{verified}.")
    if same_disk:
        out.print("[yellow]note:[/] the under-storage here is a directory on the same disk as the "
                  "cache, so writing straight to it is as fast as the disk itself; acache's point "
                  "shows with a slower under-storage: --ufs /mnt/nfs/dir, --ufs s3://bucket/prefix "
                  "or --local-s3.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/demo", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ufs", help="under-storage: a directory, file:///dir or s3://bucket/prefix "
                                  "(default: a temp directory)")
    ap.add_argument("--local-s3", action="store_true",
                    help="start a local S3-protocol server (moto) as the under-storage")
    ap.add_argument("--home", type=Path, help="use the running node of this ACACHE_HOME and its mount")
    ap.add_argument("--engine", help="mount engine for our own node: auto, native, pyfuse3")
    ap.add_argument("--state-mb", type=int, default=256, help="checkpoint size (default 256 MiB)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--keep", type=int, default=2, help="checkpoints kept (older ones deleted)")
    ap.add_argument("--plot", type=Path, metavar="FILE.png",
                    help="also draw the table and the persist progress (needs matplotlib)")
    a = ap.parse_args(argv)
    if a.plot is not None:
        from acache.plot import PlotError, require
        try:
            require()
        except PlotError as e:
            raise SystemExit(f"demo: {e}") from None
        if not a.plot.parent.is_dir():
            raise SystemExit(f"demo: --plot {a.plot}: no directory {a.plot.parent}")
    if a.ufs and "://" not in a.ufs:
        a.ufs = f"file://{os.path.abspath(a.ufs)}"
    if a.home and (a.ufs or a.local_s3 or a.engine):
        ap.error("--home uses a running node as it is: no --ufs, --local-s3 or --engine with it")

    import torch
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    # SIGTERM (and Ctrl-C) unwind through the finally below: the node and mount go away
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = Path(tempfile.mkdtemp(prefix="acache-demo-"))
    tag = f"acache-demo-{os.getpid()}"
    owned = env = None
    node = None
    direct = None
    try:
        env = {}
        if a.local_s3:
            try:        # the benchmark harness (bench/ at the repository's top, not installed)
                from bench.procs import Owned
                from bench.targets import S3Server
            except ImportError:
                raise SystemExit("demo: --local-s3 needs the repository's bench/ package on the path "
                                 "(run scripts/demo from a checkout)") from None
            owned = Owned()
            try:
                srv = S3Server(root).start(owned)
            except (OSError, RuntimeError) as e:
                raise SystemExit(f"demo: could not start the local S3 server ({e}); "
                                 "pip install 'moto[server]'") from None
            env = srv.acache_env()
            os.environ.update(env)          # for our own straight-to-S3 saves too
            a.ufs = f"s3://{srv.bucket}/demo"
        node = Node(root, a.home, a.ufs, a.engine, env)
        out.print("[bold]acache demo[/]: starting the node and the mount" if node.own
                  else f"[bold]acache demo[/]: using the node of {node.home}")
        st = node.start()
        ufs = st["ufs"]
        out.print(f"mount {node.mnt} ({st['engine']} engine), under-storage {ufs}; "
                  f"{a.steps} steps, a {a.state_mb} MiB checkpoint every {a.save_every} steps")
        # the straight saves go next to the under-storage prefix, not into it: the
        # mount would list them (read-through) and keep listing them once deleted
        if ufs.startswith("s3://"):
            from acache import config
            url = f"{ufs.rstrip('/')}-{tag}-direct" if ufs.rstrip("/").count("/") > 2 \
                else f"{ufs.rstrip('/')}/{tag}-direct"
            direct = DirectS3(url, dict(config.load(home=node.home).s3))
            label, ufs_dir = "S3", None
        else:
            ufs_dir = Path(ufs.removeprefix("file://"))
            beside = ufs_dir.parent / f"{ufs_dir.name}-{tag}-direct"
            direct = DirectDir(beside if os.access(ufs_dir.parent, os.W_OK)
                               else ufs_dir / f"{tag}-direct")
            label = "the directory"
        mine = ViaMount(node.mnt / tag)

        out.print("training, saving through the acache mount ...")
        sampler = Sampler(node) if a.plot is not None else None
        via, loop_a = train(mine, a.state_mb, a.steps, a.save_every, a.keep,
                            sampler.mark if sampler else None)
        flush_at = time.perf_counter() - sampler.t0 if sampler is not None else None
        flush_s = node.flush(node.mnt / tag)
        if sampler is not None:
            sampler.stop()           # and one last sample: after the barrier
        last = f"step-{via[-1][0]:06d}.pt"
        verified = ""
        if ufs_dir is not None:
            ok = _sha(ufs_dir / tag / last) == _sha(node.mnt / tag / last)
            verified = f"; its copy of {last} is {'byte-identical' if ok else '[red]DIFFERENT[/]'}"
        out.print(f"training again from the same seed, saving straight to {label} ...")
        straight, loop_d = train(direct, a.state_mb, a.steps, a.save_every, a.keep)
        same_disk = ufs_dir is not None and \
            os.stat(ufs_dir).st_dev == os.stat(st["cache_dir"]).st_dev
        report(via, straight, loop_a, loop_d, label, flush_s, verified, st, same_disk)
        if sampler is not None:
            from acache.plot import demo_figure
            demo_figure(a.plot, via, straight, sampler.samples, sampler.marks, label,
                        f"acache demo: {a.state_mb} MiB checkpoint every {a.save_every} steps, "
                        f"{st['engine']} engine, under-storage {ufs}", flush_at)
            out.print(f"plot: {a.plot}")
        return 0
    finally:
        if node is not None and node.mnt is not None:
            shutil.rmtree(node.mnt / tag, ignore_errors=True)
        if direct is not None:
            direct.close()
        if node is not None:
            node.stop()
        if owned is not None:
            owned.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    from acache.errors import AcacheError
    try:
        sys.exit(main())
    except AcacheError as e:
        sys.exit(f"demo: {e}")
