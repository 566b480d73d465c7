"""RemoteNamespace: the namespace of a cluster, as a node's mount sees it -- every operation a
request to the head (acache.cluster.head.HeadNamespace runs it there), the head's own mount
included (a plain call there).

The remote twin of acache.fs.namespace.Namespace: the same operations, the same errnos (the
namespace conformance suite runs both: tests/conformance/test_namespace.py).  What the files
open for writing on this node change in the answers -- their size and times are the local
cache file's, not what the head last recorded -- comes from the open-file layer above
(acache.cluster.client.ClientVFS) through three hooks: ``_overlay(attr)``,
``_truncate(ino, fh, size)``, ``_mtime_set_here(ino, atime_ns, mtime_ns)``.
"""
from __future__ import annotations

import errno
import itertools
import threading
import time
from typing import Callable

from acache.errors import FsError
from acache.fs.api import Base
from acache.fs.namespace import NAME_MAX
from acache.fs.types import Attr, Ctx, StatFs


# how long a directory's attributes from a create's reply may answer the kernel's next
# getattr of it (once): what the kernel itself caches attributes for (ENTRY_TIMEOUT)
DIR_ATTR_FOR = 1.0


class RemoteNamespace(Base):
    shared = True          # the mount engines: other hosts change this namespace too

    def __init__(self, ns: Callable[..., dict], cache) -> None:
        self.ns = ns                       # ns(op, **args) -> dict (raises FsError)
        self.cache = cache                 # this node's: statfs
        self.lock = threading.RLock()
        self._dirs: dict[int, list] = {}
        self._dir_fhs = itertools.count(1)
        # directory ino -> (its attributes as a create here left them, monotonic time): the
        # kernel drops a directory's attributes at each create in it and asks for them at the
        # next path walk; answered once from here, not by the head (one round trip per file)
        self._dir_attrs: dict[int, tuple[Attr, float]] = {}

    def _dir_after_create(self, parent: int, r: dict) -> None:
        pattr = r.get("pattr")           # an older head sends none
        if pattr is not None:
            self._dir_attrs[parent] = (self._attr(pattr), time.monotonic())

    def _changed(self) -> None:
        """A namespace change made here: no directory's attributes are answered from here."""
        if self._dir_attrs:
            self._dir_attrs.clear()

    # -- the open-file layer's hooks (see the module docstring) -----------------------------
    def _overlay(self, a: Attr) -> Attr:
        return a

    def _truncate(self, ino: int, fh: int | None, size: int) -> None:
        raise FsError(errno.EINVAL)

    def _mtime_set_here(self, ino: int, atime_ns: int | None, mtime_ns: int) -> None:
        return None

    # -- helpers ------------------------------------------------------------------------
    @staticmethod
    def _attr(d: dict) -> Attr:
        return Attr(**d)

    def after_failure(self, err: BaseException) -> bool:
        return False

    def attr(self, node) -> Attr:
        return self.getattr(node.ino)

    # -- namespace: the head's -----------------------------------------------------------
    def lookup(self, parent: int, name: bytes, ctx: Ctx | None = None) -> Attr:
        return self._overlay(self._attr(self.ns("lookup", parent=parent, name=name)))

    def getattr(self, ino: int, fh: int | None = None) -> Attr:
        got = self._dir_attrs.pop(ino, None) if self._dir_attrs else None
        if got is not None and time.monotonic() - got[1] < DIR_ATTR_FOR:
            return got[0]
        return self._overlay(self._attr(self.ns("getattr", ino=ino)))

    def setattr(self, ino: int, ctx: Ctx | None = None, fh: int | None = None, mode=None, uid=None,
                gid=None, size=None, atime_ns=None, mtime_ns=None) -> Attr:
        self._changed()
        if size is not None:
            self._truncate(ino, fh, size)
        if {mode, uid, gid, atime_ns, mtime_ns} == {None}:
            return self.getattr(ino)
        if mtime_ns is not None and mtime_ns >= 0:
            self._mtime_set_here(ino, atime_ns, mtime_ns)
        a = self._attr(self.ns("setattr", ino=ino, mode=mode, uid=uid, gid=gid,
                               atime_ns=atime_ns, mtime_ns=mtime_ns, ctx=_ctx(ctx)))
        return self._overlay(a)

    def mkdir(self, parent: int, name: bytes, mode: int, ctx: Ctx) -> Attr:
        self._changed()
        return self._attr(self.ns("mkdir", parent=parent, name=name, mode=mode, ctx=_ctx(ctx)))

    def symlink(self, parent: int, name: bytes, target: bytes, ctx: Ctx) -> Attr:
        self._changed()
        return self._attr(self.ns("symlink", parent=parent, name=name, target=target, ctx=_ctx(ctx)))

    def readlink(self, ino: int, ctx: Ctx | None = None) -> bytes:
        return self.ns("readlink", ino=ino)["target"]

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, ctx: Ctx) -> Attr:
        self._changed()
        return self._attr(self.ns("mknod", parent=parent, name=name, mode=mode, rdev=rdev,
                                  ctx=_ctx(ctx)))

    def unlink(self, parent: int, name: bytes, ctx: Ctx | None = None) -> None:
        self._changed()
        self.ns("unlink", parent=parent, name=name)

    def rmdir(self, parent: int, name: bytes, ctx: Ctx | None = None) -> None:
        self._changed()
        self.ns("rmdir", parent=parent, name=name)

    def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
               flags: int, ctx: Ctx | None = None) -> None:
        self._changed()
        self.ns("rename", parent_old=parent_old, name_old=name_old, parent_new=parent_new,
                name_new=name_new, flags=flags)

    def opendir(self, ino: int, ctx: Ctx | None = None) -> int:
        entries, offset = [], 0
        while True:
            r = self.ns("readdir", ino=ino, offset=offset)
            entries += [(n, self._attr(a)) for n, a in r["entries"]]
            if not r.get("more"):
                break
            offset = r["next"]
        with self.lock:
            fh = next(self._dir_fhs)
            self._dirs[fh] = entries
            return fh

    def readdir(self, fh: int, offset: int) -> list[tuple[bytes, Attr, int]]:
        with self.lock:
            entries = self._dirs.get(fh)
            if entries is None:
                raise FsError(errno.EBADF)
            return [(n, self._overlay(a), i + 1) for i, (n, a) in enumerate(entries) if i >= offset]

    def releasedir(self, fh: int) -> None:
        with self.lock:
            self._dirs.pop(fh, None)

    def fsyncdir(self, fh: int, datasync: bool) -> None:
        self.ns("sync")

    def statfs(self) -> StatFs:
        s = self.cache.statvfs()
        bs = s.f_frsize or 4096
        limit = self.cache.limit // bs
        free = max(0, min(limit - self.cache.used() // bs, s.f_bavail))
        return StatFs(bsize=1 << 20, frsize=bs, blocks=limit, bfree=free, bavail=free,
                      files=1 << 32, ffree=(1 << 32) - 1, namemax=NAME_MAX)

    def getxattr(self, ino: int, name: bytes) -> bytes:
        return self.ns("getxattr", ino=ino, name=name)["value"]

    def listxattr(self, ino: int) -> list[bytes]:
        self.ns("getattr", ino=ino)
        return []

    def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        self.ns("setxattr", ino=ino, name=name)

    def removexattr(self, ino: int, name: bytes) -> None:
        self.ns("removexattr", ino=ino, name=name)


def _ctx(ctx) -> dict:
    if ctx is None:
        return {}
    return {"uid": ctx.uid, "gid": ctx.gid, "pid": ctx.pid, "umask": ctx.umask}
