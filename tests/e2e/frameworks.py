"""Helpers of the framework tests: run a workload (tests.e2e.fw_workloads) in a
subprocess, compare trees, and check commit markers in an under-storage
directory while it changes (UfsWatcher)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from acache.data.under.file import TMP_PREFIX
from tests.e2e.fw_workloads import HF_REQUIRED, WORLD

REPO = Path(__file__).resolve().parents[2]


def workload_env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1")


def start_workload(kind: str, root: Path, phase: str = "a", events: Path | None = None,
                   log: Path | None = None) -> subprocess.Popen:
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tests.e2e.fw_workloads", kind, str(root), "--phase", phase]
    if events is not None:
        cmd += ["--events", str(events)]
    out = open(log, "ab") if log is not None else subprocess.PIPE
    try:
        return subprocess.Popen(cmd, env=workload_env(), cwd=str(REPO), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        if log is not None:
            out.close()


def run_workload(kind: str, root: Path, phase: str = "a", timeout: float = 180,
                 events: Path | None = None) -> None:
    p = start_workload(kind, root, phase, events)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(p)
        raise AssertionError(f"workload {kind} phase {phase} in {root} timed out")
    if p.returncode != 0:
        tail = "\n".join(out.decode(errors="replace").splitlines()[-30:])
        raise AssertionError(f"workload {kind} phase {phase} in {root} failed "
                             f"({p.returncode}):\n{tail}")


def kill_group(p: subprocess.Popen) -> None:
    """Kill a workload we started, and the ranks it forked (its own session)."""
    try:
        os.killpg(p.pid, 9)
    except ProcessLookupError:
        pass
    p.wait()


# -- trees ------------------------------------------------------------------------------------
def tree(root: Path) -> tuple[dict[str, bytes], set[str]]:
    """(relative file path -> bytes, set of relative dirs), hidden stage files left out."""
    files, dirs = {}, set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel != ".":
            dirs.add(rel)
        for fn in filenames:
            if fn.startswith(TMP_PREFIX):
                continue
            p = os.path.join(dirpath, fn)
            files[os.path.normpath(os.path.join(rel, fn))] = Path(p).read_bytes()
    return files, dirs


def dcp_metadata_equal(a: bytes, b: bytes) -> bool:
    """DCP's .metadata pickles a random save_id and the checkpoint path
    (storage_meta): compare everything else: what is stored where."""
    import io
    import pickle

    import torch.distributed.checkpoint  # noqa: F401  (the classes the pickle names)
    ma, mb = pickle.load(io.BytesIO(a)), pickle.load(io.BytesIO(b))
    return (ma.state_dict_metadata == mb.state_dict_metadata and ma.storage_data == mb.storage_data
            and ma.planner_data == mb.planner_data and ma.version == mb.version)


# Files whose bytes legitimately differ between two runs, and how to compare them.
LOOSE = {".metadata": dcp_metadata_equal}


def assert_same_files(expected: tuple, got: tuple, what: str, loose: dict = LOOSE) -> None:
    ef, ed = expected
    gf, gd = got
    assert sorted(gf) == sorted(ef), (f"{what}: different files\n only expected: "
                                      f"{sorted(set(ef) - set(gf))}\n only got: {sorted(set(gf) - set(ef))}")
    assert gd == ed, f"{what}: different dirs: only expected {ed - gd}, only got {gd - ed}"
    for path, data in ef.items():
        if gf[path] == data:
            continue
        cmp = loose.get(os.path.basename(path))
        assert cmp is not None and cmp(data, gf[path]), \
            f"{what}: {path} differs ({len(data)} vs {len(gf[path])} bytes)"


# -- commit markers in an under-storage directory ------------------------------------------------
_CKPT = re.compile(r"checkpoint-\d+")


def _exists_full(p: Path, need: int = 1) -> bool:
    try:
        return p.stat().st_size >= need
    except (FileNotFoundError, NotADirectoryError):
        return False


def _read(p: Path) -> bytes | None:
    try:
        return p.read_bytes()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


_parsed: dict[bytes, dict[str, int]] = {}


def _dcp_needs(marker: Path, raw: bytes) -> list[tuple[Path, int]]:
    need = _parsed.get(raw)
    if need is None:
        import io
        import pickle

        import torch.distributed.checkpoint  # noqa: F401
        md = pickle.load(io.BytesIO(raw))
        need = {}
        for info in md.storage_data.values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
        _parsed[raw] = need
    return [(marker.parent / rel, n) for rel, n in need.items()]


def needs_of(marker: Path, raw: bytes) -> list[tuple[Path, int]] | None:
    """What a commit marker promises: [(file, minimum size)], or None if it is no marker."""
    name, d = marker.name, marker.parent
    if name == ".metadata":
        return _dcp_needs(marker, raw)
    if name == "latest_checkpointed_iteration.txt":           # Megatron-LM
        try:
            it = int(raw.decode().strip())
        except ValueError:
            return None          # empty / half-written tracker: not a marker (yet)
        return [(d / f"iter_{it:07d}" / f"mp_rank_{r:02d}" / "model_optim_rng.pt", 1)
                for r in range(WORLD)]
    if name == "latest" and d.name == "deepspeed":           # DeepSpeed
        tag = raw.decode(errors="replace").strip()
        if not tag.startswith("global_step"):
            return None
        return [(d / tag / "mp_rank_00_model_states.pt", 1)] + \
            [(d / tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", 1) for r in range(WORLD)]
    if name == "trainer_state.json" and _CKPT.fullmatch(d.name):   # HF Trainer
        return [(d / f, 1) for f in HF_REQUIRED]
    return None


def violations(root: Path, excluded=lambda rel: False, staging_dirs=False) -> list[str]:
    """Commit markers under ``root`` whose promised files are missing or short.

    A finding is re-checked (the marker is still there with the same bytes after
    the files were looked at) so a concurrent delete/rename is not reported.
    ``excluded(rel_dir)`` names directories the workload itself was deleting.
    With ``staging_dirs`` (a bool, or a predicate of the relative directory),
    a checkpoint-N directory is itself a commit marker (it was renamed into
    place fully populated)."""
    staged = staging_dirs if callable(staging_dirs) else (lambda rel: bool(staging_dirs))
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        rel_d = os.path.relpath(d, root)
        if _CKPT.fullmatch(d.name) and staged(rel_d) and not excluded(rel_d):
            missing = [f for f in ("trainer_state.json", *HF_REQUIRED) if not _exists_full(d / f)]
            if missing and d.exists() and not excluded(rel_d):
                out.append(f"{rel_d}/ is in the under-storage without {missing}")
        for fn in filenames:
            if fn.startswith(TMP_PREFIX):
                continue
            marker = d / fn
            raw = _read(marker)
            if raw is None:
                continue
            try:
                needs = needs_of(marker, raw)
            except Exception as e:   # a marker that does not parse is a finding too
                if _read(marker) == raw:
                    out.append(f"{os.path.relpath(marker, root)} does not parse: {e!r}")
                continue
            if not needs:
                continue
            missing = [str(p.relative_to(root)) for p, n in needs if not _exists_full(p, n)]
            if missing and _read(marker) == raw and not excluded(rel_d):
                out.append(f"{os.path.relpath(marker, root)} ({raw[:40]!r}) is in the "
                           f"under-storage without {missing}")
    return out


class UfsWatcher:
    """Polls an under-storage directory from a thread, collecting marker violations."""

    def __init__(self, root: Path, excluded=lambda rel: False, staging_dirs=False,
                 interval: float = 0.05) -> None:
        self.root, self.excluded, self.staging_dirs = root, excluded, staging_dirs
        self.interval = interval
        self.found: list[str] = []
        self.scans = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="ufs-watcher", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                v = violations(self.root, self.excluded, self.staging_dirs)
            except Exception as e:   # a bug in the checker must not pass silently
                v = [f"watcher error: {e!r}"]
            for x in v:
                if x not in self.found:
                    self.found.append(x)
            self.scans += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> "UfsWatcher":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(30)


def read_events(path: Path) -> list[tuple[float, str]]:
    """The workload's events file: [(time.time(), "save ckpt/step1"), ...]."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for ln in text.splitlines():
        t, _, what = ln.partition("\t")
        if what:
            out.append((float(t), what))
    return out


def rmtree_excluder(events: Path, prefix: str):
    """``excluded(rel_dir)`` for UfsWatcher: the directory (``prefix``/...) or one
    above it was logged by the workload as being removed.  Read afresh at each
    call, i.e. after the under-storage was looked at: a delete reaches the
    under-storage only after the workload logged it."""
    def excluded(rel_dir: str) -> bool:
        gone = [f"{prefix}/{w.split(' ', 1)[1]}" for _, w in read_events(events)
                if w.startswith("rmtree ")]
        return any(rel_dir == g or rel_dir.startswith(g + "/") for g in gone)
    return excluded


def wait_for_event(path: Path, prefix: str, timeout: float,
                   proc: subprocess.Popen | None = None) -> float | None:
    """Wait until the workload logs an event starting with ``prefix``; its time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for t, what in read_events(path):
            if what.startswith(prefix):
                return t
        if proc is not None and proc.poll() is not None:
            return None
        time.sleep(0.01)
    return None
