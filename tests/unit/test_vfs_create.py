"""What a create costs on the cache disk: its cache file is opened once (the open its
handle keeps), and a create that fails leaves neither the file nor an open fd behind."""
import errno
import os

import pytest

from acache.errors import FsError
from acache.fs.types import ROOT_INO, Ctx
from tests.unit.test_meta_rollback import FailingKV
from tests.unit.test_vfs_journal import Rig

CTX = Ctx()


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path, kv=FailingKV(), flush_delay=3600)
    yield r
    r.stop()


def opens_under(monkeypatch, root: str) -> list[str]:
    """The paths below ``root`` that os.open is asked for from now on."""
    seen: list[str] = []
    real = os.open

    def counting(path, *a, **kw):
        if str(path).startswith(root):
            seen.append(str(path))
        return real(path, *a, **kw)
    monkeypatch.setattr(os, "open", counting)
    return seen


def test_a_create_opens_its_cache_file_once(rig, monkeypatch):
    opened = opens_under(monkeypatch, rig.cache.root)
    fh, a = rig.vfs.create(ROOT_INO, b"f", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
    assert opened == [rig.cache.path(a.ino, 0)]
    assert rig.vfs.write(fh, 0, b"x" * 4096) == 4096
    rig.vfs.flush(fh)
    rig.vfs.release(fh)
    assert not rig.cache.is_open(a.ino, 0)
    with open(rig.cache.path(a.ino, 0), "rb") as f:
        assert f.read() == b"x" * 4096


def test_a_failed_create_leaves_no_file_and_no_fd(rig):
    fds_before = len(os.listdir("/proc/self/fd"))
    rig.kv.fail = True
    with pytest.raises(FsError) as e:
        rig.vfs.create(ROOT_INO, b"f", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
    assert e.value.errno == errno.EIO
    assert rig.cache._fds == {} and len(os.listdir("/proc/self/fd")) == fds_before
    assert rig.cache.known() == set()
    rig.kv.fail = False
    fh, a = rig.vfs.create(ROOT_INO, b"f", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
    rig.vfs.release(fh)
    assert rig.vfs.lookup(ROOT_INO, b"f").ino == a.ino
