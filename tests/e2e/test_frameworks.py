"""Real checkpoint workloads, unmodified, through the mount (issue 4).

Each test runs the same workload (tests/e2e/fw_workloads.py, real torch /
safetensors / transformers calls, CPU only) on a plain local directory (once per
session, shared by the engines) and on the acache mount, then after
`acache flush --wait` requires:
  * the under-storage holds exactly the files and directories of the local run,
    with identical bytes — except DCP's `.metadata`, which pickles a random
    save_id, and is compared by what it says is stored where (LOOSE);
  * the under-storage holds exactly what the mount shows, byte for byte;
  * while it persisted, no commit marker was ever visible in the under-storage
    without the files it promises (UfsWatcher polls it from a thread).
The workloads check what they read back themselves (load, mmap, resume).

Skipped only when `import torch` fails; the CI installs the `torch` extra
(torch==2.13.0 CPU, safetensors, transformers, accelerate), so they run there.
"""
from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the framework tests need torch (pip install -e .[torch])")

from tests.e2e.conftest import ENGINES, engine_fixture  # noqa: E402
from tests.e2e.frameworks import (UfsWatcher, assert_same_files, read_events,  # noqa: E402
                                  rmtree_excluder, run_workload, tree)

pytestmark = [pytest.mark.e2e, pytest.mark.torch]

engine = engine_fixture(ENGINES)    # native-nopt: covered by the crash/model/contract/S3 suites


_local_trees: dict[tuple[str, str], tuple] = {}


@pytest.fixture(scope="session")
def local_root(tmp_path_factory):
    return tmp_path_factory.mktemp("local-runs")


def local_run(local_root, kind: str, phase: str) -> tuple:
    """The workload on a plain local directory, once per session (engine-independent);
    the phases of one workload run in order in the same directory."""
    if (kind, phase) not in _local_trees:
        run_workload(kind, local_root / kind, phase)
        _local_trees[(kind, phase)] = tree(local_root / kind)
    return _local_trees[(kind, phase)]


def both(node, local_root, tmp_path, kind: str, phase: str = "a", watcher_kw=None) -> list[str]:
    """Run ``kind`` on a local directory and on the mount (watched), then compare;
    returns the workload's events."""
    local = local_run(local_root, kind, phase)
    events = tmp_path / f"{kind}.events"
    with UfsWatcher(node.ufs_dir, excluded=rmtree_excluder(events, kind), **(watcher_kw or {})) as w:
        run_workload(kind, node.mnt / kind, phase, events=events)
        node.flush()
        ufs = tree(node.ufs_dir / kind)
        assert_same_files(tree(node.mnt / kind), ufs, "mount vs under-storage", loose={})
        assert_same_files(local, ufs, "local run vs under-storage")
    assert not w.found, w.found
    assert w.scans > 0
    return [what for _, what in read_events(events)]


def test_torch_save_load_overwrite(make_node, local_root, tmp_path):
    # a 10 s flush delay: in phase a nothing has started persisting when model.pt is
    # overwritten (flush --wait skips the delay)
    node = make_node(flush_delay=10.0)
    # phase a: save 80 MiB, torch.load (also mmap=True), overwrite in place before it persisted
    both(node, local_root, tmp_path, "torch_save", "a")
    # phase b: overwrite in place after it was persisted (both() flushed it)
    both(node, local_root, tmp_path, "torch_save", "b")
    # phase c: a new node with an empty cache over the same under-storage reads it
    # back through the mount (read-through), torch.load(mmap=True) included
    node.stop()
    shutil.rmtree(node.home / "cache")
    node.start()
    run_workload("torch_save", node.mnt / "torch_save", "c")


def test_safetensors(node, local_root, tmp_path):
    both(node, local_root, tmp_path, "safetensors")
    # save_file creates its hidden temp with mode 0600 and renames it: the mode survives
    mode = (node.mnt / "safetensors" / "model.safetensors").stat().st_mode & 0o777
    assert mode == (local_root / "safetensors" / "model.safetensors").stat().st_mode & 0o777


def test_dcp_two_ranks(node, local_root, tmp_path):
    # 2 ranks (gloo, 127.0.0.1), default FileSystemWriter: save, load into a fresh
    # state, save again into the same directory, async_save into another
    both(node, local_root, tmp_path, "dcp")


def test_megatron_deepspeed_trackers(node, local_root, tmp_path):
    both(node, local_root, tmp_path, "sharded")


def test_hf_trainer_rotation_resume(make_node, local_root, tmp_path):
    # save_steps=2, save_total_limit=2 (rotation by directory mtime), then
    # resume_from_checkpoint.  A 5 s flush delay makes rotation rmtree checkpoints
    # whose uploads are still pending (cancelled: no traffic); the staging test
    # below, with the usual 0.2 s, mostly deletes persisted ones; the crash test
    # hits both at random moments.
    node = make_node(flush_delay=5.0)
    events = both(node, local_root, tmp_path, "hf")
    states = [e for e in events if e.startswith("states ")]
    print(states)
    assert any("dirty=" in e or "persisting=" in e for e in states), states


def test_hf_trainer_staging_rename(node, local_root, tmp_path):
    # tmp-checkpoint-N populated, then renamed to checkpoint-N: the directory
    # itself is the commit marker
    events = both(node, local_root, tmp_path, "hf_staging", watcher_kw={"staging_dirs": True})
    print([e for e in events if e.startswith("states ")])


def _s3_snapshot(srv, prefix: str, dest: Path) -> None:
    """One listing of s3://bucket/prefix/ materialized as files of the same sizes
    (sparse), so that ``violations`` can judge it: a listing is one snapshot."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for o in srv.client().list_objects(srv.bucket, prefix=prefix + "/", recursive=True):
        if o.object_name.endswith("/"):
            continue
        p = dest / o.object_name[len(prefix) + 1:]
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:
            f.truncate(o.size or 0)


def test_hf_trainer_staging_rename_s3(local_root, tmp_path):
    """The staging pattern over an S3 under-storage (moto), uploads throttled to 5 MiB/s
    so that rotation usually deletes checkpoints still persisting (their states at the
    rmtree are printed): S3 cannot rename a prefix in one
    step, so checkpoint-N appears object by object there; what must hold is the
    commit marker: trainer_state.json (closed last) never lands before the files
    closed before it.  The bucket ends up with the local run's files, same bytes."""
    from tests.acache_node import AcacheNode, fuse_mounts
    from tests.e2e.conftest import ENGINES
    from tests.e2e.frameworks import violations
    pytest.importorskip("moto", reason="the S3 tests need moto (pip install -e .[test])")
    from tests.s3server import S3Server

    with S3Server() as srv:
        srv.throttle = 5 << 20
        env = {f"ACACHE_S3_{k.upper()}": str(v) for k, v in srv.options().items()}
        # the S3 side does not depend on the engine: one is enough
        node = AcacheNode(tmp_path / "n", engine=ENGINES[-1], ufs=srv.url("fw"), extra_env=env)
        found: list[str] = []
        stop = threading.Event()
        events = tmp_path / "hf_staging.events"
        excluded = rmtree_excluder(events, "hf_staging")
        snap = Path(tempfile.mkdtemp(dir=tmp_path))

        def poll() -> None:
            while not stop.is_set():
                try:
                    _s3_snapshot(srv, "fw", snap)
                    found.extend(v for v in violations(snap, excluded) if v not in found)
                except Exception as e:   # noqa: BLE001 - reported below
                    found.append(f"poller: {e!r}")
                stop.wait(0.1)
        t = threading.Thread(target=poll, daemon=True)
        try:
            node.start()
            local = local_run(local_root, "hf_staging", "a")
            t.start()
            run_workload("hf_staging", node.mnt / "hf_staging", "a", events=events)
            node.flush()
        finally:
            stop.set()
            t.join(30)
            node.stop()
        assert not found, found
        c = srv.client()
        got = {}
        for o in c.list_objects(srv.bucket, prefix="fw/hf_staging/", recursive=True):
            if not o.object_name.endswith("/"):
                r = c.get_object(srv.bucket, o.object_name)
                got[o.object_name[len("fw/hf_staging/"):]] = r.read()
                r.close()
                r.release_conn()
        assert_same_files((local[0], set()), (got, set()), "local run vs S3")
        assert str(node.mnt) not in fuse_mounts()
        print([what for _, what in read_events(events) if what.startswith("states ")])
