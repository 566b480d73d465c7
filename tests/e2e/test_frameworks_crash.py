"""kill -9 of acache at random moments while real frameworks checkpoint and it
persists (issue 4; DESIGN.md points 4 and 6).

For each framework, a few iterations on one node: start the workload (phase
"crash": several checkpoints into fresh directories) on the mount, wait for its
first save, sleep a random time within the save-and-persist window, kill -9 the
node, let the workload fail, restart the node, `acache flush --wait`.  Then:
  * the under-storage holds exactly what the mount shows, byte for byte
    (everything acknowledged before the crash reached it, nothing torn);
  * at no moment did the under-storage hold a commit marker (DCP `.metadata`,
    Megatron `latest_checkpointed_iteration.txt`, DeepSpeed `latest`, a
    checkpoint's `trainer_state.json`; for the staging pattern the
    `checkpoint-N` directory itself) without every file written before it:
    UfsWatcher polls it from a thread through the save, the persist, the crash,
    the restart and the flush; the final state is checked once more.
Checkpoints the workload itself was deleting (Trainer rotation) are left out of
the marker check, from the `rmtree` lines it logs before each delete.

The seed of the kill times is printed; ACACHE_CRASH_SEED=<n> replays a run.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import time

import pytest

pytest.importorskip("torch", reason="the framework tests need torch (pip install -e .[torch])")

from tests.e2e.frameworks import (UfsWatcher, assert_same_files, kill_group,  # noqa: E402
                                  read_events, rmtree_excluder, start_workload, tree, violations,
                                  wait_for_event)

pytestmark = [pytest.mark.e2e, pytest.mark.torch, pytest.mark.slow]

ITERATIONS = int(os.environ.get("ACACHE_CRASH_ITERATIONS", "3"))
# seconds after the first save starts within which the kill lands: about the
# workload's save time on the mount plus its persist time
WINDOW = {"dcp": 3.5, "sharded": 2.5, "hf": 6.5, "hf_staging": 7.0}


def _kill9(pid: int) -> None:
    """kill -9 at this very moment (AcacheNode.kill9 first asks the CLI for the pid)."""
    os.kill(pid, signal.SIGKILL)
    for _ in range(200):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)


def _log(path) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-25:])
    except FileNotFoundError:
        return ""


@pytest.mark.parametrize("kind", list(WINDOW))
def test_kill9_during_save_and_persist(node, tmp_path, kind):
    seed = int(os.environ.get("ACACHE_CRASH_SEED", random.randrange(1 << 30)))
    print(f"ACACHE_CRASH_SEED={seed}")
    rng = random.Random(f"{kind}-{seed}")
    excluders = {}

    def excluded(rel: str) -> bool:
        sub = rel.split("/", 1)[0]
        return sub in excluders and excluders[sub](rel)

    staging = kind == "hf_staging"
    with UfsWatcher(node.ufs_dir, excluded=excluded, staging_dirs=staging) as w:
        for i in range(ITERATIONS):
            sub = f"{kind}-{i}"
            events, log = tmp_path / f"{sub}.events", tmp_path / f"{sub}.log"
            excluders[sub] = rmtree_excluder(events, sub)
            pid = node.pid()
            p = start_workload(kind, node.mnt / sub, phase="crash", events=events, log=log)
            try:
                t0 = wait_for_event(events, "save", 120, p)
                assert t0 is not None, f"no save started:\n{_log(log)}"
                delay = rng.uniform(0.0, WINDOW[kind])
                time.sleep(max(0.0, t0 + delay - time.time()))
                _kill9(pid)
                t_kill = time.time()
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    pass
            finally:
                kill_group(p)
            done = [t for t, what in read_events(events) if what == "done"]
            when = f"{t_kill - done[0]:.2f}s after the workload finished" if done \
                else "during the workload"
            print(f"{sub}: kill -9 {t_kill - t0:.2f}s after the first save ({when})")
            node.restart()
            node.flush()
            mnt, ufs = tree(node.mnt / sub), tree(node.ufs_dir / sub)
            assert_same_files(mnt, ufs, f"{sub}: mount vs under-storage after restart", loose={})
    assert w.scans > 10
    assert not w.found, f"seed {seed}: " + "\n".join(w.found)
    final = violations(node.ufs_dir, excluded, staging)
    assert not final, f"seed {seed}: " + "\n".join(final)
