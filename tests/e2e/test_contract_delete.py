"""Contract, point 5: unlink/rmdir/rmtree of data that is dirty, persisting or
persisted.  A delete cancels the pending upload; nothing deleted ever comes back."""
from __future__ import annotations

import os
import shutil
import time

from tests.e2e.contract_util import Poller, pattern, ufs_names, ufs_real


def test_delete_cancels_pending_upload(make_node):
    n = make_node(flush_delay=0.5)
    with Poller(n.ufs_dir) as poll:
        for i in range(10):
            p = n.mnt / f"tmp{i}"
            p.write_bytes(pattern(1 << 20, i))
            os.unlink(p)
        (n.mnt / "keep").write_bytes(b"keep")
        time.sleep(1.0)          # past the flush delay
        n.flush()
    assert poll.ever_seen() <= {"keep"}
    assert ufs_real(n.ufs_files()) == {"keep": b"keep"}
    st = n.status()
    assert st["persisted_files"] == 1 and st["persisted_bytes"] == 4


def test_unlink_and_rmtree_of_dirty_files(make_node):
    n = make_node(flush_delay=30)
    d = n.mnt / "ckpt"
    (d / "sub").mkdir(parents=True)
    for i in range(5):
        (d / f"s{i}").write_bytes(pattern(100_000, i))
        (d / "sub" / f"s{i}").write_bytes(pattern(100_000, i + 10))
    fd = os.open(d / "open-dirty", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"still open")
    os.unlink(d / "s0")
    shutil.rmtree(d)            # while one file is still open for writing
    os.write(fd, b" and written after the unlink")
    os.close(fd)
    assert not d.exists()
    n.flush()
    assert ufs_real(n.ufs_files()) == {}
    assert os.listdir(n.ufs_dir) == []


def test_rmtree_while_persisting_never_resurrects(space):
    n = space
    d = n.mnt / "ckpt"
    d.mkdir()
    for i in range(12):
        (d / f"shard{i}").write_bytes(pattern(4 << 20, i))
    shutil.rmtree(d)            # uploads of the first shards are under way
    (n.mnt / "after").write_bytes(b"after")
    n.flush()
    assert ufs_real(n.ufs_files()) == {"after": b"after"}
    time.sleep(1.0)             # nothing lands late either
    assert ufs_names(n.ufs_dir) == {"after": 5}
    assert not (n.ufs_dir / "ckpt").exists()


def test_unlink_persisted_and_recreate(space):
    m = space.mnt
    (m / "d").mkdir()
    (m / "d" / "f").write_bytes(b"one")
    space.flush()
    os.unlink(m / "d" / "f")
    (m / "d" / "f").write_bytes(b"two")      # same name, new file
    os.unlink(m / "d" / "f")
    os.rmdir(m / "d")
    space.flush()
    assert ufs_real(space.ufs_files()) == {}
    assert os.listdir(space.ufs_dir) == []
    (m / "d").mkdir()
    (m / "d" / "f").write_bytes(b"three")
    space.flush()
    assert ufs_real(space.ufs_files()) == {"d/f": b"three"}


def test_deleted_files_stay_deleted_after_crash(make_node):
    n = make_node(flush_delay=30)
    for i in range(5):
        (n.mnt / f"f{i}").write_bytes(pattern(50_000, i))
    for i in range(0, 5, 2):
        os.unlink(n.mnt / f"f{i}")
    n.kill9()
    n.restart()
    assert sorted(os.listdir(n.mnt)) == ["f1", "f3"]
    n.flush()
    assert sorted(ufs_real(n.ufs_files())) == ["f1", "f3"]
