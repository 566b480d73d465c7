"""What a cluster node answers without asking the head: the kernel's getxattr of a file it
has open for writing (the kernel asks for security.capability at a file's first write), and
the kernel's next getattr of a directory it just created a file in (the kernel drops the
directory's attributes at each create): one round trip per file each.  Anything else still
goes to the head.  One layer: a real cache directory, a recording stand-in for the head."""
from __future__ import annotations

import errno
import os

import pytest

from acache.cluster.client import ClientVFS
from acache.data.cache import CacheDir
from acache.data.under.mem import MemStore
from acache.errors import FsError
from acache.fs.types import STATE_XATTR, Ctx

ATTR = dict(ino=5, mode=0o100644, nlink=1, uid=0, gid=0, size=0, atime_ns=0, mtime_ns=0,
            ctime_ns=0)


DIR = dict(ATTR, ino=1, mode=0o040755, nlink=2, mtime_ns=77)


class Head:
    def __init__(self) -> None:
        self.ops: list[str] = []

    def __call__(self, op: str, **args) -> dict:
        self.ops.append(op)
        if op == "create":
            return {"ino": 5, "gen": 1, "same": False, "src": None, "holder": "n2", "attr": ATTR,
                    "pattr": DIR}
        if op == "getattr":
            return DIR if args["ino"] == 1 else ATTR
        if op == "getxattr":
            if args["name"] == STATE_XATTR:
                return {"value": b"dirty"}
            raise FsError(errno.ENODATA)
        return {}


def test_getxattr_of_a_file_written_here_needs_no_head(tmp_path):
    head = Head()
    cache = CacheDir(str(tmp_path / "cache"), 1 << 30, 5)
    vfs = ClientVFS("n2", cache, MemStore("mem://t"), head, lambda node: None)
    fh, _ = vfs.create(1, b"f", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
    head.ops.clear()
    with pytest.raises(FsError) as ei:
        vfs.getxattr(5, b"security.capability")
    assert ei.value.errno == errno.ENODATA and head.ops == []
    assert vfs.getxattr(5, STATE_XATTR) == b"dirty" and head.ops == ["getxattr"]
    vfs.write(fh, 0, b"x" * 10)
    vfs.flush(fh)
    vfs.release(fh)
    head.ops.clear()
    with pytest.raises(FsError) as ei:       # not open here any more: the head answers
        vfs.getxattr(5, b"security.capability")
    assert ei.value.errno == errno.ENODATA and head.ops == ["getxattr"]


def test_the_directory_a_create_changed_is_answered_once_from_its_reply(tmp_path):
    head = Head()
    cache = CacheDir(str(tmp_path / "cache"), 1 << 30, 5)
    vfs = ClientVFS("n2", cache, MemStore("mem://t"), head, lambda node: None)
    fh, _ = vfs.create(1, b"f", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
    head.ops.clear()
    assert vfs.getattr(1).mtime_ns == 77 and head.ops == []       # from the create's reply
    assert vfs.getattr(1).mtime_ns == 77 and head.ops == ["getattr"]   # once only
    vfs.release(fh)
    fh, _ = vfs.create(1, b"g", 0o644, os.O_WRONLY | os.O_CREAT, Ctx())
    vfs.unlink(1, b"f")               # a later change here: the reply is out of date
    head.ops.clear()
    vfs.getattr(1)
    assert head.ops == ["getattr"]
    vfs.release(fh)
