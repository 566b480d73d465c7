"""What a FUSE engine calls: the ``FileSystem`` protocol, and ``Base``, its optional parts.

The engines (acache.fs.pyfuse3_engine, acache.fs.native) serve a mount from one object with
these methods: one host's VFS (acache.fs.vfs), a cluster node's (acache.cluster.client), a
cacheless client's (acache.cluster.cacheless), or a test's in-memory one.  Everything is
called by name; what a file system may leave out has its default in ``Base``, so an engine
never probes with getattr/hasattr.  Errors are FsError(errno).

Capabilities (class attributes):
  * ``shared``: other hosts change this namespace too (a cluster): the kernel keeps no
    directory listings and drops a file's attributes at every open (close-to-open);
  * ``ordered_closes``: this object's namespace is one host's MetaStore, whose ``op`` scope
    lets closes that overlapped in time commit together (acache.fs.overlap); a cluster's
    head orders the closes it is sent instead.
"""
from __future__ import annotations

import errno
import os
from typing import Protocol

from acache.errors import FsError
from acache.fs.types import Attr, Ctx, StatFs


class FileSystem(Protocol):
    shared: bool
    ordered_closes: bool

    # names
    def lookup(self, parent: int, name: bytes, ctx: Ctx | None = None) -> Attr: ...
    def lookup_fast(self, parent: int, name: bytes) -> Attr | None: ...
    def getattr(self, ino: int, fh: int | None = None) -> Attr: ...
    def getattr_fast(self, ino: int) -> Attr | None: ...
    def setattr(self, ino: int, ctx: Ctx | None = None, fh: int | None = None, mode=None, uid=None,
                gid=None, size=None, atime_ns=None, mtime_ns=None) -> Attr: ...
    def mkdir(self, parent: int, name: bytes, mode: int, ctx: Ctx) -> Attr: ...
    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, ctx: Ctx) -> Attr: ...
    def symlink(self, parent: int, name: bytes, target: bytes, ctx: Ctx) -> Attr: ...
    def readlink(self, ino: int, ctx: Ctx | None = None) -> bytes: ...
    def unlink(self, parent: int, name: bytes, ctx: Ctx | None = None) -> None: ...
    def rmdir(self, parent: int, name: bytes, ctx: Ctx | None = None) -> None: ...
    def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
               flags: int, ctx: Ctx | None = None) -> None: ...
    def incref(self, ino: int) -> None: ...
    def forget(self, items) -> None: ...
    # directories
    def opendir(self, ino: int, ctx: Ctx | None = None) -> int: ...
    def readdir(self, fh: int, offset: int) -> list[tuple[bytes, Attr, int]]: ...
    def releasedir(self, fh: int) -> None: ...
    def fsyncdir(self, fh: int, datasync: bool) -> None: ...
    def statfs(self) -> StatFs: ...
    # extended attributes
    def getxattr(self, ino: int, name: bytes) -> bytes: ...
    def listxattr(self, ino: int) -> list[bytes]: ...
    def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None: ...
    def removexattr(self, ino: int, name: bytes) -> None: ...
    # open files
    def create(self, parent: int, name: bytes, mode: int, flags: int, ctx) -> tuple[int, Attr]: ...
    # same_file: a write open must keep the generation's file (else NewFile, nothing changed)
    def open(self, ino: int, flags: int, ctx=None, same_file: bool = False) -> int: ...
    def read(self, fh: int, offset: int, size: int) -> bytes | bytearray: ...
    def write(self, fh: int, offset: int, data) -> int: ...
    def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None: ...
    # unique: the FUSE request's number (0: not known), for close_began's token
    def flush(self, fh: int, unique: int = 0) -> None: ...
    # the engine read a FLUSH of fh (its reader thread: must not block); before flush() runs
    def close_began(self, fh: int, unique: int) -> None: ...
    def fsync(self, fh: int, datasync: bool) -> None: ...
    def release(self, fh: int) -> None: ...
    def handle_ino(self, fh: int) -> int | None: ...
    def is_open(self, ino: int) -> bool: ...
    def passthrough_fd(self, fh: int, opening: bool = False) -> int | None: ...
    # the cache file fh reads and writes, passed through or not (None: bytes come from elsewhere)
    def backing_fd(self, fh: int) -> int | None: ...
    # after an operation failed half-way: undo what it changed in memory (True: it did)
    def after_failure(self, err: BaseException) -> bool: ...


class Base:
    """The parts of FileSystem an implementation may leave out, with what they then mean."""
    shared = False
    ordered_closes = False

    def lookup_fast(self, parent: int, name: bytes) -> Attr | None:
        return None                       # no answer from memory: the engine calls lookup

    # the kernel's lookup counts: inodes live in the store, whoever knows their number, so
    # there is nothing to keep or drop (an unlinked file lives while it is open, not looked up)
    def incref(self, ino: int) -> None:
        return None

    def forget(self, items) -> None:
        return None

    def getattr_fast(self, ino: int) -> Attr | None:
        return None

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, ctx: Ctx) -> Attr:
        """A regular file made by mknod(2): created empty and closed."""
        fh, a = self.create(parent, name, mode, os.O_CREAT | os.O_EXCL | os.O_WRONLY, ctx)  # type: ignore[attr-defined]
        self.flush(fh)                    # type: ignore[attr-defined]
        self.release(fh)                  # type: ignore[attr-defined]
        return a

    def symlink(self, parent: int, name: bytes, target: bytes, ctx: Ctx) -> Attr:
        raise FsError(errno.EPERM)

    def readlink(self, ino: int, ctx: Ctx | None = None) -> bytes:
        raise FsError(errno.EINVAL)       # nothing here is a link

    def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None

    def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        # EOPNOTSUPP, never ENOSYS: that would disable fallocate for the whole mount
        raise FsError(errno.EOPNOTSUPP)

    def handle_ino(self, fh: int) -> int | None:
        return None

    def passthrough_fd(self, fh: int, opening: bool = False) -> int | None:
        return None                       # every byte through the daemon

    def backing_fd(self, fh: int) -> int | None:
        return None                       # no cache file of its own here

    def close_began(self, fh: int, unique: int) -> None:
        return None                       # closes are ordered where they run (one host)

    def after_failure(self, err: BaseException) -> bool:
        return False
