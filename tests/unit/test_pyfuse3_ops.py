"""The pyfuse3 adapter's inline answers: what it must answer without a worker thread."""
from __future__ import annotations

import errno

import pyfuse3
import pytest
import trio

from acache.fs.pyfuse3_engine import Ops
from acache.fs.types import STATE_XATTR
from acache.fs.api import Base


class CountingVFS(Base):
    """Records every call; getxattr answers like the VFS does for the state name."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def getxattr(self, ino, name):
        self.calls.append("getxattr")
        return b"dirty"


def _getxattr(ops, name):
    async def main():
        return await ops.getxattr(5, name, None)
    return trio.run(main)


@pytest.mark.parametrize("name", [b"security.capability", b"system.posix_acl_access",
                                  b"user.foo", b"user.acache.other"])
def test_unknown_xattr_is_answered_inline(name):
    # the kernel asks for security.capability before every WRITE: no worker-thread hop
    vfs = CountingVFS()
    with pytest.raises(pyfuse3.FUSEError) as ei:
        _getxattr(Ops(vfs), name)
    assert ei.value.errno == errno.ENODATA
    assert vfs.calls == []


def test_state_xattr_goes_to_the_vfs():
    vfs = CountingVFS()
    assert _getxattr(Ops(vfs), STATE_XATTR) == b"dirty"
    assert vfs.calls == ["getxattr"]


def test_stop_fallback_runs_no_shell(tmp_path, monkeypatch):
    """When the loop does not end, the mount is detached with an argument list: a
    mount path holding a quote and ``$(...)`` never runs a command."""
    from acache.fs.pyfuse3_engine import Pyfuse3Engine
    monkeypatch.chdir(tmp_path)      # a shell would run `touch pwned` here
    marker = tmp_path / "pwned"
    mnt = tmp_path / "it's a $(touch pwned) mount"
    mnt.mkdir()
    eng = Pyfuse3Engine(None, str(mnt))
    eng._token = object()            # a loop that never answers terminate()
    eng.stop_timeout = 0.05
    eng.stop()
    assert not marker.exists(), "the mount path was run by a shell"
    assert mnt.is_dir()
