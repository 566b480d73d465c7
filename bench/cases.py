"""The cases. In every rep, each target runs once, in an order rotated from rep to rep, next
to its baselines; between two measurements the target that just ran is settled (acache:
flush --wait; rclone: its uploads done; a plain directory: sync) and emptied, so one
measurement's background work does not leak into the next."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from rich.console import Console

from bench import fio
from bench.meta import LABELS as META_LABELS, OPS as META_OPS, run_meta
from bench import stressng
from bench.ckpt import CkptWorkers, WorkerError
from bench.procs import Owned, drop_caches
from bench.report import Measurement
from bench.targets import AcacheTarget, RcloneTarget, S3Server

MiB = 1 << 20
PART, PARALLEL = 16 * MiB, 8     # acache's s3:// defaults, used for the direct upload too


def rotate(xs: list, k: int) -> list:
    return xs[k % len(xs):] + xs[:k % len(xs)] if xs else xs


# -- places: somewhere to write, and how to settle it ----------------------------------------
class Place:
    def __init__(self, id: str, base: Path) -> None:
        self.id, self.base = id, base

    def dir(self, sub: str) -> Path:
        d = self.base / sub
        d.mkdir(parents=True, exist_ok=True)
        return d

    def settle(self) -> None:
        os.sync()

    def clear(self, sub: str) -> None:
        if os.path.lexists(self.base / sub):
            shutil.rmtree(self.base / sub)
        self.settle()


class AcachePlace(Place):
    def __init__(self, id: str, node: AcacheTarget) -> None:
        super().__init__(id, node.mnt / "bench")
        self.node = node

    def settle(self) -> None:
        self.node.flush()
        os.sync()


class RclonePlace(Place):
    def __init__(self, id: str, rc: RcloneTarget) -> None:
        super().__init__(id, rc.mnt / "bench")
        self.rc = rc

    def settle(self) -> None:
        self.rc.wait_uploaded()


class Bench:
    def __init__(self, args, owned: Owned, console: Console, root: Path) -> None:
        self.a, self.owned, self.console, self.root = args, owned, console, root
        self.ms: list[Measurement] = []
        self.notes: list[str] = []
        self.engines: dict[str, dict] = {e: {"mounted": None} for e in args.engines}
        self.raw = root / "raw"
        self.ufs_dir = root / "ufs-dir"
        for d in (self.raw, self.ufs_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._s3: S3Server | None = None
        self._s3_tried = False
        self._nodes: dict[tuple[str, str], AcacheTarget | None] = {}
        self._rclone: RcloneTarget | None = None
        self._rclone_tried = False
        self.broken: set[tuple] = set()
        self._warned_drop = False

    # -- lazily started targets --------------------------------------------------------------
    def note(self, msg: str) -> None:
        self.notes.append(msg)
        self.console.print(f"[yellow]note:[/] {msg}", highlight=False)

    def s3(self) -> S3Server | None:
        if not self._s3_tried and not self.a.no_s3:
            self._s3_tried = True
            d = self.root / "s3"
            d.mkdir(exist_ok=True)
            try:
                self._s3 = S3Server(d).start(self.owned)
                self.console.log(f"S3 server (moto) on {self._s3.endpoint}")
            except Exception as e:
                self.note(f"the S3 server did not start ({e}); S3 targets skipped")
        return self._s3

    def node(self, engine: str, kind: str) -> AcacheTarget | None:
        """The acache node of this engine over a file:// or s3:// under-storage."""
        key = (engine, kind)
        if key in self._nodes:
            return self._nodes[key]
        self._nodes[key] = None
        info = self.engines[engine]
        if info["mounted"] is False:
            return None
        s3 = self.s3() if kind == "s3" else None
        if kind == "s3" and s3 is None:
            return None
        root = self.root / f"acache-{engine}-{kind}"
        ufs = f"s3://{s3.bucket}/acache-{engine}" if s3 else f"file://{self.root / f'ufs-{engine}'}"
        t = AcacheTarget(root, engine, ufs, s3.acache_env() if s3 else None)
        t0 = time.monotonic()
        if not t.start(self.owned, self.a.mount_timeout):
            info.update(mounted=False, note=t.note)
            self.note(f"acache {engine} engine skipped: {t.note}")
            t.stop()
            return None
        info.update(mounted=True, passthrough=t.passthrough, note="")
        self.console.log(f"acache {engine} mounted at {t.mnt} over {ufs} in "
                         f"{time.monotonic() - t0:.1f}s{' (kernel passthrough)' if t.passthrough else ''}")
        self._nodes[key] = t
        return t

    def rclone(self) -> RcloneTarget | None:
        if self._rclone_tried or 5 not in self.a.cases:
            return self._rclone
        self._rclone_tried = True
        if shutil.which("rclone") is None:
            self.note("rclone is not installed: case 5 skipped")
            return None
        s3 = self.s3()
        if s3 is None:
            return None
        d = self.root / "rclone"
        d.mkdir(exist_ok=True)
        rc = RcloneTarget(d, s3)
        if rc.start(self.owned):
            self._rclone = rc
            self.console.log(f"rclone mounted at {rc.mnt}")
        else:
            self.note(f"rclone skipped: {rc.note}")
        return self._rclone

    def acache_places(self, kind: str) -> list[AcachePlace]:
        out = []
        for e in self.a.engines:
            n = self.node(e, kind)
            if n is not None:
                out.append(AcachePlace(f"acache-{e}", n))
        return out

    # -- one measurement ----------------------------------------------------------------------
    def measure(self, case: int, test: str, target: str, rep: int, primary: str,
                baseline: str | None, fn, record: bool = True) -> dict | None:
        if (case, test, target) in self.broken:
            return None
        try:
            metrics = fn()
        except Exception as e:
            self.broken.add((case, test, target))
            self.note(f"case {case}, {test}, {target}, rep {rep + 1}: {type(e).__name__}: {e}")
            return None
        if record:
            self.ms.append(Measurement(case, test, target, rep, metrics, primary, baseline))
            shown = ", ".join(f"{k} {v:.3g}" for k, v in metrics.items() if isinstance(v, float))
            self.console.log(f"case {case} · {test} · rep {rep + 1}/{self.a.repeat} · {target}: {shown}",
                             highlight=False)
        return metrics

    def settle(self, p: Place, sub: str | None = None) -> bool:
        try:
            if sub is not None:
                p.clear(sub)
            else:
                p.settle()
            return True
        except Exception as e:
            self.broken.add(("*", p.id))
            self.note(f"{p.id}: settling failed, target dropped: {type(e).__name__}: {e}")
            return False

    # -- cases 1 and 2 ---------------------------------------------------------------------------
    def fio_cases(self) -> None:
        cases = self.a.cases
        size = self.a.fio_size
        places: list[Place] = [Place("raw", self.raw), *self.acache_places("file")]
        if 1 in cases and self.rclone() is not None:
            places.append(RclonePlace("rclone", self._rclone))
        for jobs in (1, 4):
            js = f"{jobs} job{'s' if jobs > 1 else ''}"
            wtest, rtest, dtest = f"write, {js}", f"read, {js}", "DCP-like 4 KiB reads, tail first"
            for rep in range(self.a.repeat):
                for p in rotate(places, rep):
                    if ("*", p.id) in self.broken:
                        continue
                    sub = f"fio-{jobs}"
                    d = p.base / sub
                    w = self.measure(1, wtest, p.id, rep, "mib_s", "raw",
                                     lambda: fio.run_fio(p.dir(sub), "write", size, jobs),
                                     record=1 in cases)
                    if w is None or not self.settle(p):
                        self.settle(p, sub)
                        continue
                    if 2 in cases and not isinstance(p, RclonePlace):
                        if not drop_caches() and not self._warned_drop:
                            self._warned_drop = True
                            self.note("could not drop the page cache (not root?): reads may be warm")
                        self.measure(2, rtest, p.id, rep, "mib_s", "raw",
                                     lambda: fio.run_fio(d, "read", size, jobs))
                        if jobs == 1:
                            drop_caches()
                            self.measure(2, dtest, p.id, rep, "iops", "raw",
                                         lambda: fio.dcp_read(fio.fio_files(d, 1)[0]))
                    self.settle(p, sub)

    # -- case 3 ------------------------------------------------------------------------------------
    def ckpt_case(self) -> None:
        s3 = self.s3()
        kind = "s3" if s3 else "file"
        places: list = [Place("raw", self.raw), Place("dir", self.ufs_dir)]
        if s3:
            places.append("s3")
        places += self.acache_places(kind)
        if self.rclone() is not None:
            places.append(RclonePlace("rclone", self._rclone))
        env = dict(os.environ, **(s3.worker_env() if s3 else {}),
                   BENCH_S3_BUCKET=s3.bucket if s3 else "")
        for wkind, test in (("save", "torch.save"), ("dcp", "DCP save, 2 ranks")):
            workers = self._workers(wkind, env)
            try:
                if workers is not None:     # the first save of a process pays for warm-up: untimed
                    warm = Place("raw", self.raw)
                    try:
                        workers.save({"path": str(warm.dir("warmup") / "ckpt")}, self.a.op_timeout)
                    except WorkerError as e:
                        self.note(f"{test}: the warm-up save failed: {e}")
                        workers.close()
                        workers = None
                    warm.clear("warmup")
                for rep in range(self.a.repeat):
                    for p in rotate(places, rep):
                        if workers is None:
                            break
                        pid = p if p == "s3" else p.id
                        if ("*", pid) in self.broken:
                            continue
                        name = f"ckpt-{wkind}-{rep}"
                        cmd = {"s3": f"direct/{name}"} if p == "s3" else {"path": str(p.dir("ckpt") / name)}
                        if (3, test, pid) in self.broken:
                            continue
                        ok = self.measure(3, test, pid, rep, "seconds", "raw",
                                          lambda: {"seconds": workers.save(cmd, self.a.op_timeout)})
                        if ok is None:       # a rank may be stuck in a collective: start afresh
                            workers.close()
                            workers = self._workers(wkind, env)
                        if p == "s3":
                            s3.empty("direct/")
                        else:
                            self.settle(p, "ckpt")
            finally:
                if workers is not None:
                    workers.close()

    def _workers(self, kind: str, env: dict) -> CkptWorkers | None:
        w = CkptWorkers(self.owned, kind, self.a.size, env)
        try:
            w.start(self.a.op_timeout)
            return w
        except WorkerError as e:
            w.close()
            self.note(f"the {kind} checkpoint workers did not start: {e}")
            return None

    # -- case 4 ------------------------------------------------------------------------------------
    def persist_case(self) -> None:
        size = self.a.size
        src = self.raw / "persist-src.bin"
        with open(src, "wb") as f:
            left = size
            while left > 0:
                n = min(left, 8 * MiB)
                f.write(os.urandom(n))
                left -= n
        os.sync()
        tests = []
        s3 = self.s3()
        if s3:
            tests.append(("to S3", "upload", self.acache_places("s3")))
        tests.append(("to a directory", "cp", self.acache_places("file")))
        for rep in range(self.a.repeat):
            for test, base, places in tests:
                for p in rotate([base, *places], rep):
                    pid = p if isinstance(p, str) else p.id
                    if ("*", pid) in self.broken:
                        continue
                    fn = {"upload": lambda: self._upload(s3, src), "cp": lambda: self._cp(src)}.get(
                        pid) or (lambda p=p: self._through(p, src))
                    self.measure(4, test, pid, rep, "mib_s", base, fn)
                    if isinstance(p, Place):
                        self.settle(p, "persist")
        src.unlink()

    @staticmethod
    def _rate(nbytes: int, seconds: float) -> dict:
        return {"mib_s": nbytes / MiB / seconds, "seconds": seconds}

    def _upload(self, s3: S3Server, src: Path) -> dict:
        # the same page-cache state as acache's: a file written just now (a save to local
        # disk, then its upload), whose dirty pages the kernel writes back meanwhile
        fresh = self.raw / "persist-fresh.bin"
        shutil.copyfile(src, fresh)
        c = s3.client()
        t0 = time.perf_counter()
        c.fput_object(s3.bucket, "upload/persist.bin", str(fresh), part_size=PART,
                      num_parallel_uploads=PARALLEL)
        dt = time.perf_counter() - t0
        fresh.unlink()
        s3.empty("upload/")
        return self._rate(src.stat().st_size, dt)

    def _cp(self, src: Path) -> dict:
        dst = self.ufs_dir / "persist.bin"
        t0 = time.perf_counter()
        subprocess.run(["cp", str(src), str(dst)], check=True)
        subprocess.run(["sync", str(dst)], check=True)          # fsync, as a persister does
        dt = time.perf_counter() - t0
        dst.unlink()
        return self._rate(src.stat().st_size, dt)

    # -- case 6 ------------------------------------------------------------------------------------
    def meta_case(self) -> None:
        """Metadata ops/s: each target runs every operation on the same files, next to the
        raw directory on the cache filesystem; settled and emptied between targets."""
        places: list[Place] = [Place("raw", self.raw), *self.acache_places("file")]
        n = self.a.meta_files
        for rep in range(self.a.repeat):
            for p in rotate(places, rep):
                if ("*", p.id) in self.broken or (6, "*", p.id) in self.broken:
                    continue
                sub = "meta"
                try:
                    rates = run_meta(p.base / sub, n)
                except Exception as e:
                    self.broken.add((6, "*", p.id))
                    self.note(f"case 6, {p.id}, rep {rep + 1}: {type(e).__name__}: {e}")
                    self.settle(p, sub)
                    continue
                for op in META_OPS:
                    self.measure(6, META_LABELS[op], p.id, rep, "ops_s", "raw",
                                 lambda op=op: {"ops_s": rates[op]})
                self.settle(p, sub)

    # -- case 7 ------------------------------------------------------------------------------------
    def stressng_case(self) -> None:
        """stress-ng's metadata stressors (issue 10's measurement): each stressor on each
        target in turn, next to the raw directory on the cache filesystem."""
        if not stressng.available():
            self.note("stress-ng is not installed: case 7 skipped (Debian package stress-ng)")
            return
        places: list[Place] = [Place("raw", self.raw), *self.acache_places("file")]
        for rep in range(self.a.repeat):
            for s in self.a.stressors:
                for p in rotate(places, rep):
                    if ("*", p.id) in self.broken:
                        continue
                    sub = "stress-ng"
                    self.measure(7, stressng.LABELS[s], p.id, rep, "ops_s", "raw",
                                 lambda: {"ops_s": stressng.run_stressor(
                                     p.dir(sub), s, self.a.stress_seconds)})
                    self.settle(p, sub)

    def _through(self, p: AcachePlace, src: Path) -> dict:
        dst = p.dir("persist") / "persist.bin"
        shutil.copyfile(src, dst)                 # closed here: persisting may start now
        return self._rate(src.stat().st_size, p.node.flush(self.a.op_timeout))
