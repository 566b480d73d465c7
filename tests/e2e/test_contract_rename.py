"""Contract, points 1 and 5: rename of files and directories on a real mount,
POSIX errors, RENAME_NOREPLACE; the under-storage after `flush --wait` shows only
the final names."""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile

import pytest

from tests.e2e.contract_util import Poller, pattern, ufs_real

_libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
RENAME_NOREPLACE = 1


def renameat2(src, dst, flags: int) -> None:
    if _libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(src))


@pytest.mark.parametrize("persisted_target", [False, True])
def test_rename_onto_existing_file_dcp_metadata(space, persisted_target):
    n = space
    ck = n.mnt / "step-1"
    ck.mkdir()
    (ck / ".metadata").write_bytes(b"old metadata")
    if persisted_target:
        n.flush()
    new = pattern(200_000, 1)
    (ck / ".metadata.tmp").write_bytes(new)
    os.rename(ck / ".metadata.tmp", ck / ".metadata")
    assert sorted(os.listdir(ck)) == [".metadata"]
    assert (ck / ".metadata").read_bytes() == new
    n.flush()
    assert ufs_real(n.ufs_files()) == {"step-1/.metadata": new}


def test_rename_safetensors_mkstemp_to_final(space):
    d = space.mnt / "hf"
    d.mkdir()
    final = d / "model.safetensors"
    final.write_bytes(b"v0")
    for v in range(3):
        data = pattern(300_000 + v, v)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp")
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
        os.chmod(tmp, 0o600)
        os.replace(tmp, final)
        assert final.read_bytes() == data
        assert os.listdir(d) == ["model.safetensors"]
        assert os.stat(final).st_mode & 0o777 == 0o600
    space.flush()
    assert ufs_real(space.ufs_files()) == {"hf/model.safetensors": data}


@pytest.mark.parametrize("persisted", [False, True])
def test_rename_populated_directory(space, persisted):
    n = space
    src = n.mnt / "tmp-ckpt"
    (src / "sub").mkdir(parents=True)
    files = {"a.bin": pattern(70_000, 1), "sub/b.bin": pattern(2 << 20, 2), "sub/c": b"c"}
    for k, v in files.items():
        (src / k).write_bytes(v)
    (src / "empty").mkdir()
    if persisted:
        n.flush()
        assert set(ufs_real(n.ufs_files())) == {f"tmp-ckpt/{k}" for k in files}
    (n.mnt / "final").mkdir()
    os.rename(src, n.mnt / "final" / "ckpt")   # into another directory
    assert not src.exists()
    for k, v in files.items():
        assert (n.mnt / "final" / "ckpt" / k).read_bytes() == v
    n.flush()
    assert ufs_real(n.ufs_files()) == {f"final/ckpt/{k}": v for k, v in files.items()}
    assert not (n.ufs_dir / "tmp-ckpt").exists()
    assert (n.ufs_dir / "final" / "ckpt" / "empty").is_dir()
    # and back onto an existing empty directory
    (n.mnt / "back").mkdir()
    os.rename(n.mnt / "final" / "ckpt", n.mnt / "back")
    n.flush()
    assert ufs_real(n.ufs_files()) == {f"back/{k}": v for k, v in files.items()}


def test_rename_posix_errors(space):
    m = space.mnt
    (m / "d1" / "x").mkdir(parents=True)
    (m / "d1" / "x" / "f").write_bytes(b"f")
    (m / "d2").mkdir()
    (m / "d2" / "g").write_bytes(b"g")
    (m / "empty").mkdir()
    (m / "file").write_bytes(b"file")

    def err(fn, *a) -> int:
        with pytest.raises(OSError) as ei:
            fn(*a)
        return ei.value.errno

    assert err(os.rename, m / "d1", m / "d2") in (errno.ENOTEMPTY, errno.EEXIST)
    assert err(os.rename, m / "file", m / "d2") == errno.EISDIR
    assert err(os.rename, m / "d1", m / "file") == errno.ENOTDIR
    assert err(os.rmdir, m / "d2") == errno.ENOTEMPTY
    assert err(os.rmdir, m / "file") == errno.ENOTDIR
    assert err(os.unlink, m / "d2") in (errno.EISDIR, errno.EPERM)
    assert err(os.rename, m / "d1", m / "d1" / "x" / "inside") == errno.EINVAL
    assert err(os.rename, m / "missing", m / "y") == errno.ENOENT
    assert err(os.mkdir, m / "d2") == errno.EEXIST
    # the cases POSIX allows: dir onto an empty dir, file onto file, across dirs (no EXDEV)
    os.rename(m / "d1", m / "empty")
    os.rename(m / "d2" / "g", m / "empty" / "x" / "f")
    os.rename(m / "file", m / "empty" / "file")
    os.rename(m / "empty" / "file", m / "empty" / "file")   # onto itself: nothing
    assert (m / "empty" / "x" / "f").read_bytes() == b"g"
    space.flush()
    assert ufs_real(space.ufs_files()) == {"empty/x/f": b"g", "empty/file": b"file"}
    assert sorted(os.listdir(space.ufs_dir)) == ["d2", "empty"]


def test_rename_noreplace(space):
    m = space.mnt
    (m / "a").write_bytes(b"a")
    (m / "b").write_bytes(b"b")
    with pytest.raises(OSError) as ei:
        renameat2(m / "a", m / "b", RENAME_NOREPLACE)
    assert ei.value.errno == errno.EEXIST
    assert (m / "a").read_bytes() == b"a" and (m / "b").read_bytes() == b"b"
    renameat2(m / "a", m / "c", RENAME_NOREPLACE)
    assert sorted(os.listdir(m)) == ["b", "c"]
    space.flush()
    assert ufs_real(space.ufs_files()) == {"b": b"b", "c": b"a"}


def test_rename_unpersisted_costs_no_traffic_for_old_name(make_node):
    """torch.save-style: write `x.tmp`, close, rename to `x` -- with a small flush delay,
    the old names never show in the under-storage and each file is uploaded once."""
    n = make_node(flush_delay=0.5)
    files = {f"x{i}.pt": pattern(300_000 + i, i) for i in range(12)}
    with Poller(n.ufs_dir) as poll:
        for name, data in files.items():
            (n.mnt / f"{name}.tmp").write_bytes(data)
            os.rename(n.mnt / f"{name}.tmp", n.mnt / name)
        n.flush()
    seen = poll.ever_seen()
    assert not {s for s in seen if s.endswith(".tmp")}, seen
    assert ufs_real(n.ufs_files()) == files
    st = n.status()
    assert st["persisted_files"] == len(files)
    assert st["persisted_bytes"] == sum(len(v) for v in files.values())


def test_rename_of_file_while_persisting_leaves_one_name(space):
    n = space
    for i in range(6):
        (n.mnt / f"t{i}").write_bytes(pattern(6 << 20, i))
        os.rename(n.mnt / f"t{i}", n.mnt / f"f{i}")
    n.flush()
    assert sorted(ufs_real(n.ufs_files())) == [f"f{i}" for i in range(6)]


def test_rename_dir_then_rmtree_old_contents(space):
    """Rotation as HF Trainer does: save to checkpoint-N, later rmtree the oldest."""
    m = space.mnt
    for step in (1, 2, 3):
        d = m / f"checkpoint-{step}"
        d.mkdir()
        (d / "model.safetensors").write_bytes(pattern(500_000, step))
        (d / "trainer_state.json").write_text(f'{{"step": {step}}}')
        if step == 2:
            space.flush()
    shutil.rmtree(m / "checkpoint-1")
    shutil.rmtree(m / "checkpoint-2")
    space.flush()
    assert sorted(ufs_real(space.ufs_files())) == ["checkpoint-3/model.safetensors",
                                                  "checkpoint-3/trainer_state.json"]
    assert sorted(os.listdir(space.ufs_dir)) == ["checkpoint-3"]
