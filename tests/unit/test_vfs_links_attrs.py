"""Symbolic links and attributes through the VFS + journal + persister (mem:// store)."""
import errno
import os

import pytest

from acache.data.under.base import Attrs
from acache.errors import FsError
from acache.fs.types import ROOT_INO, Ctx
from acache.meta.kv_mem import MemKV

try:
    from .test_vfs_journal import Rig, rig  # noqa: F401 (a fixture)
except ImportError:
    from test_vfs_journal import Rig, rig  # noqa: F401

CTX = Ctx(uid=1000, gid=1001)


@pytest.fixture
def slow(tmp_path):
    """A rig whose entries wait until hurried (drain): changes collapse before that."""
    r = Rig(tmp_path, flush_delay=3600)
    yield r
    r.stop()


def ops(rig, *names):
    return [c for c in rig.store.calls if c[0] in names]


def test_symlink_is_journaled_and_lands_as_a_link(slow):
    d = slow.mkdir(ROOT_INO, b"checkpoint-3")
    slow.write(d, b"w", b"weights")
    a = slow.vfs.symlink(ROOT_INO, b"latest", b"checkpoint-3", CTX)
    assert os.path.stat.S_ISLNK(a.mode) and a.size == len(b"checkpoint-3")
    assert (a.uid, a.gid) == (1000, 1001)
    assert slow.vfs.readlink(a.ino) == b"checkpoint-3"
    assert slow.vfs.lookup(ROOT_INO, b"latest").ino == a.ino
    with pytest.raises(FsError) as e:
        slow.vfs.readlink(d)
    assert e.value.errno == errno.EINVAL
    assert slow.vfs.state(slow.meta.get(a.ino)) == "dirty"
    slow.drain()
    assert [c[1] for c in slow.store.calls if c[0] in ("mkdir", "commit", "symlink")] == \
        ["checkpoint-3", "checkpoint-3/w", "latest"]        # in the order they were made
    st = slow.store.state
    assert "latest" in st.links and st.files["latest"][0] == b"checkpoint-3"
    assert (st.attrs["latest"].uid, st.attrs["latest"].gid) == (1000, 1001)
    assert slow.vfs.state(slow.meta.get(a.ino)) == "persisted"


def test_empty_or_long_target_is_refused(slow):
    with pytest.raises(FsError) as e:
        slow.vfs.symlink(ROOT_INO, b"l", b"", CTX)
    assert e.value.errno == errno.ENOENT
    with pytest.raises(FsError) as e:
        slow.vfs.symlink(ROOT_INO, b"l", b"x" * 4096, CTX)
    assert e.value.errno == errno.ENAMETOOLONG
    slow.vfs.symlink(ROOT_INO, b"l", b"t", CTX)
    with pytest.raises(FsError) as e:
        slow.vfs.symlink(ROOT_INO, b"l", b"t", CTX)
    assert e.value.errno == errno.EEXIST


def test_rename_and_delete_of_an_unpersisted_link_cost_nothing(slow):
    slow.vfs.symlink(ROOT_INO, b"tmp-latest", b"checkpoint-3", CTX)
    slow.vfs.rename(ROOT_INO, b"tmp-latest", ROOT_INO, b"latest", 0)
    slow.vfs.symlink(ROOT_INO, b"gone", b"x", CTX)
    slow.vfs.unlink(ROOT_INO, b"gone")
    slow.drain()
    assert ops(slow, "symlink", "rename", "delete") == [("symlink", "latest")]
    assert slow.store.state.files["latest"][0] == b"checkpoint-3"


def test_rename_of_a_persisted_link_is_a_rename(rig):
    a = rig.vfs.symlink(ROOT_INO, b"a", b"target", CTX)
    rig.drain()
    rig.vfs.rename(ROOT_INO, b"a", ROOT_INO, b"b", 0)
    rig.drain()
    assert ops(rig, "rename") == [("rename", "a -> b")]
    assert "b" in rig.store.state.links and "a" not in rig.store.state.files
    assert rig.meta.get(a.ino).upath == "b"


def test_attrs_land_with_the_put_and_changes_collapse_into_it(slow):
    ino = slow.write(ROOT_INO, b"f", b"data")
    slow.vfs.setattr(ino, CTX, mode=0o600)
    slow.vfs.setattr(ino, CTX, uid=7, gid=8)
    slow.vfs.setattr(ino, CTX, mtime_ns=1_700_000_000_123_456_789)
    slow.drain()
    assert len(ops(slow, "stage")) == 1 and not ops(slow, "set_attrs")
    assert slow.store.state.attrs["f"] == Attrs(0o600, 7, 8, 1_700_000_000_123_456_789)


def test_chmod_of_a_persisted_file_is_metadata_only(rig):
    ino = rig.write(ROOT_INO, b"f", b"data")
    d = rig.mkdir(ROOT_INO, b"d")
    rig.drain()
    assert len(ops(rig, "stage")) == 1
    rig.vfs.setattr(ino, CTX, mode=0o600)
    rig.vfs.setattr(d, CTX, mode=0o700, uid=5)
    assert rig.vfs.state(rig.meta.get(ino)) in ("dirty", "persisting")
    rig.drain()
    assert len(ops(rig, "stage")) == 1                # no re-upload
    assert ops(rig, "set_attrs") == [("set_attrs", "f"), ("set_attrs", "d")]
    assert rig.store.state.attrs["f"].mode == 0o600
    assert (rig.store.state.attrs["d"].mode, rig.store.state.attrs["d"].uid) == (0o700, 5)
    assert rig.vfs.state(rig.meta.get(ino)) == "persisted"


def test_attrs_of_a_file_deleted_before_they_land_are_dropped(slow):
    ino = slow.write(ROOT_INO, b"f", b"data")
    slow.drain()
    slow.vfs.setattr(ino, CTX, mode=0o600)
    slow.vfs.unlink(ROOT_INO, b"f")
    slow.drain()
    assert not ops(slow, "set_attrs") and ops(slow, "delete") == [("delete", "f")]


def test_cold_cache_lists_links_and_attrs_back(tmp_path):
    r = Rig(tmp_path / "a")
    d = r.vfs.mkdir(ROOT_INO, b"ck", 0o700, CTX).ino
    f = r.write(d, b"shard", b"secret")
    r.vfs.setattr(f, CTX, mode=0o600, uid=1000, gid=1001, mtime_ns=1_600_000_000_000_000_001)
    r.vfs.symlink(ROOT_INO, b"latest", b"ck", CTX)
    r.drain()
    r.stop()
    cold = Rig(tmp_path / "b", store=r.store.reopen(), kv=MemKV())   # a wiped cache
    try:
        link = cold.vfs.lookup(ROOT_INO, b"latest")
        assert os.path.stat.S_ISLNK(link.mode) and cold.vfs.readlink(link.ino) == b"ck"
        ck = cold.vfs.lookup(ROOT_INO, b"ck")
        assert ck.mode & 0o7777 == 0o700 and (ck.uid, ck.gid) == (1000, 1001)
        shard = cold.vfs.lookup(ck.ino, b"shard")
        assert shard.mode & 0o7777 == 0o600 and (shard.uid, shard.gid) == (1000, 1001)
        assert shard.mtime_ns == 1_600_000_000_000_000_001
    finally:
        cold.stop()


def test_unknown_attrs_keep_the_defaults(tmp_path):
    r = Rig(tmp_path)
    try:
        import time
        r.store.state.files["other/x"] = (b"by another tool", time.time())
        o = r.vfs.lookup(ROOT_INO, b"other")
        x = r.vfs.lookup(o.ino, b"x")
        assert o.mode & 0o7777 == 0o755 and x.mode & 0o7777 == 0o644
        assert (x.uid, x.gid) == (0, 0)
    finally:
        r.stop()


def test_pending_links_and_attrs_survive_a_crash(tmp_path):
    from acache.data.under.mem import MemState, MemStore
    from acache.meta.kv_rocks import RocksKV
    state = MemState()
    kv = RocksKV(str(tmp_path / "db"))
    r = Rig(tmp_path, store=MemStore("mem://c", state=state), kv=kv)
    ino = r.write(ROOT_INO, b"f", b"data")
    r.drain()
    r.p._stop = True                         # "kill -9": nothing more is applied
    r.vfs.symlink(ROOT_INO, b"latest", b"ck-7", CTX)
    r.vfs.setattr(ino, CTX, mode=0o600)
    kv.close()
    kv2 = RocksKV(str(tmp_path / "db"))
    r2 = Rig(tmp_path, store=MemStore("mem://c", state=state), kv=kv2)
    try:
        r2.drain()
        assert "latest" in state.links and state.files["latest"][0] == b"ck-7"
        assert state.attrs["f"].mode == 0o600 and state.files["f"][0] == b"data"
    finally:
        r2.stop()
        kv2.close()
