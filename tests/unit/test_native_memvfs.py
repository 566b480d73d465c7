"""A small VFS for the native engine's tests: metadata in memory, file data in a real
backing directory (one file per inode, so kernel passthrough has something to point at).

It implements the method set the engine calls on acache.fs.vfs, with the same rules
(FsError(errno), bytes names, lookup counts), plus hooks tests use: per-name lookup
delays, names whose data is "not local" (no passthrough), call counters, and a list of
bookkeeping violations (e.g. a lookup count going negative) that tests assert empty.

The module also holds the engine-independent unit tests of the wire helpers.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from acache.errors import FsError
from acache.fs.native import proto
from acache.fs.api import Base
from acache.fs.types import (RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INO, STATE_XATTR,
                             UTIME_NOW, Attr, Ctx, StatFs)

XATTR_CREATE, XATTR_REPLACE = 1, 2


@dataclass
class Node:
    ino: int
    mode: int
    uid: int = 0
    gid: int = 0
    nlink: int = 1
    lookups: int = 0
    children: dict[bytes, int] | None = None
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    gen: int = 0


@dataclass
class Handle:
    ino: int
    fd: int
    flags: int


class MemVFS(Base):
    def __init__(self, backing_dir: str, *, passthrough: bool = True,
                 cow_on_write: bool = False):
        # cow_on_write: like acache's VFS, a write open of a file that others hold open
        # gets a fresh cache file (a new generation) and leaves the old one to them.
        self.cow_on_write = cow_on_write
        self.backing_dir = backing_dir
        os.makedirs(backing_dir, exist_ok=True)
        self.passthrough = passthrough
        self.lock = threading.RLock()
        now = time.time_ns()
        self.nodes: dict[int, Node] = {
            ROOT_INO: Node(ROOT_INO, stat.S_IFDIR | 0o755, nlink=2, children={},
                           atime_ns=now, mtime_ns=now, ctime_ns=now)}
        self.next_ino = 2
        self.handles: dict[int, Handle] = {}
        self.dirs: dict[int, tuple[int, list]] = {}
        self.next_fh = 1
        self.calls: Counter = Counter()
        self.violations: list[str] = []
        self.lookup_delay: dict[bytes, float] = {}
        self.lookups_running: Counter = Counter()
        self.remote_names: set[bytes] = set()       # opens of these are never passthrough
        self.remote_inos: set[int] = set()

    # --- helpers ---------------------------------------------------------------------------

    def path(self, ino: int) -> str:
        n = self.nodes.get(ino)
        return os.path.join(self.backing_dir, f"{ino}.{n.gen if n else 0}")

    def _node(self, ino: int) -> Node:
        try:
            return self.nodes[ino]
        except KeyError:
            raise FsError(errno.ENOENT) from None

    def _dir(self, ino: int) -> Node:
        n = self._node(ino)
        if n.children is None:
            raise FsError(errno.ENOTDIR)
        return n

    def _attr(self, n: Node) -> Attr:
        if stat.S_ISREG(n.mode):
            fds = [h.fd for h in self.handles.values() if h.ino == n.ino]
            st = os.fstat(fds[-1]) if fds else os.stat(self.path(n.ino))
            return Attr(n.ino, n.mode, n.nlink, n.uid, n.gid, st.st_size, st.st_atime_ns,
                        st.st_mtime_ns, st.st_ctime_ns, st.st_blocks)
        size = 4096 if n.children is not None else 0
        return Attr(n.ino, n.mode, n.nlink, n.uid, n.gid, size, n.atime_ns, n.mtime_ns,
                    n.ctime_ns)

    def _new(self, parent: Node, name: bytes, mode: int, ctx: Ctx) -> Node:
        now = time.time_ns()
        n = Node(self.next_ino, mode, ctx.uid, ctx.gid, atime_ns=now, mtime_ns=now,
                 ctime_ns=now)
        self.next_ino += 1
        self.nodes[n.ino] = n
        parent.children[name] = n.ino
        parent.mtime_ns = parent.ctime_ns = now
        if name in self.remote_names:
            self.remote_inos.add(n.ino)
        return n

    def _drop(self, ino: int) -> None:
        n = self.nodes.get(ino)
        if n is None or n.nlink > 0 or n.lookups > 0:
            return
        if any(h.ino == ino for h in self.handles.values()):
            return
        del self.nodes[ino]
        if stat.S_ISREG(n.mode):
            try:
                os.unlink(self.path(ino))
            except FileNotFoundError:
                pass

    # --- names -----------------------------------------------------------------------------

    def lookup(self, parent: int, name: bytes, ctx: Ctx) -> Attr:
        delay = self.lookup_delay.get(name)
        if delay:
            self.lookups_running[name] += 1
            try:
                time.sleep(delay)
            finally:
                self.lookups_running[name] -= 1
        with self.lock:
            p = self._dir(parent)
            ino = p.children.get(name)
            if ino is None:
                raise FsError(errno.ENOENT)
            n = self.nodes[ino]
            n.lookups += 1
            return self._attr(n)

    def forget(self, items: list[tuple[int, int]]) -> None:
        with self.lock:
            for ino, count in items:
                n = self.nodes.get(ino)
                if n is None:
                    if ino != ROOT_INO:
                        self.violations.append(f"forget of unknown ino {ino}")
                    continue
                n.lookups -= count
                if n.lookups < 0 and ino != ROOT_INO:
                    self.violations.append(f"ino {ino} lookup count {n.lookups}")
                self._drop(ino)

    def incref(self, ino: int) -> None:
        with self.lock:
            self._node(ino).lookups += 1

    def mkdir(self, parent: int, name: bytes, mode: int, ctx: Ctx) -> Attr:
        with self.lock:
            p = self._dir(parent)
            if name in p.children:
                raise FsError(errno.EEXIST)
            n = self._new(p, name, stat.S_IFDIR | (mode & 0o7777 & ~ctx.umask), ctx)
            n.children, n.nlink, n.lookups = {}, 2, 1
            return self._attr(n)

    def create(self, parent: int, name: bytes, mode: int, flags: int, ctx: Ctx):
        with self.lock:
            p = self._dir(parent)
            if name in p.children:
                if flags & os.O_EXCL:
                    raise FsError(errno.EEXIST)
                ino = p.children[name]
                fh = self.open(ino, flags & ~os.O_CREAT, ctx)
                self.nodes[ino].lookups += 1
                return fh, self._attr(self.nodes[ino])
            n = self._new(p, name, stat.S_IFREG | (mode & 0o7777), ctx)
            n.lookups = 1
            os.close(os.open(self.path(n.ino), os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600))
            fh = self.open(n.ino, flags & ~(os.O_CREAT | os.O_EXCL), ctx)
            return fh, self._attr(n)

    def unlink(self, parent: int, name: bytes, ctx: Ctx) -> None:
        with self.lock:
            p = self._dir(parent)
            ino = p.children.get(name)
            if ino is None:
                raise FsError(errno.ENOENT)
            if self.nodes[ino].children is not None:
                raise FsError(errno.EISDIR)
            del p.children[name]
            self.nodes[ino].nlink = 0
            self._drop(ino)

    def rmdir(self, parent: int, name: bytes, ctx: Ctx) -> None:
        with self.lock:
            p = self._dir(parent)
            ino = p.children.get(name)
            if ino is None:
                raise FsError(errno.ENOENT)
            n = self.nodes[ino]
            if n.children is None:
                raise FsError(errno.ENOTDIR)
            if n.children:
                raise FsError(errno.ENOTEMPTY)
            del p.children[name]
            n.nlink = 0
            p.nlink -= 1
            self._drop(ino)

    def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
               flags: int, ctx: Ctx) -> None:
        if flags & RENAME_EXCHANGE or flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE):
            raise FsError(errno.EINVAL)
        with self.lock:
            po, pn = self._dir(parent_old), self._dir(parent_new)
            ino = po.children.get(name_old)
            if ino is None:
                raise FsError(errno.ENOENT)
            target = pn.children.get(name_new)
            if target == ino:
                return
            if target is not None:
                if flags & RENAME_NOREPLACE:
                    raise FsError(errno.EEXIST)
                src, dst = self.nodes[ino], self.nodes[target]
                if dst.children is not None:
                    if src.children is None:
                        raise FsError(errno.EISDIR)
                    if dst.children:
                        raise FsError(errno.ENOTEMPTY)
                elif src.children is not None:
                    raise FsError(errno.ENOTDIR)
                dst.nlink = 0
            del po.children[name_old]
            pn.children[name_new] = ino
            if target is not None:
                self._drop(target)

    # --- attributes ------------------------------------------------------------------------

    def getattr(self, ino: int, fh: int | None = None) -> Attr:
        with self.lock:
            if fh is not None:
                self.calls["getattr_fh"] += 1
            return self._attr(self._node(ino))

    def setattr(self, ino: int, ctx: Ctx, fh: int | None = None, mode: int | None = None,
                uid: int | None = None, gid: int | None = None, size: int | None = None,
                atime_ns: int | None = None, mtime_ns: int | None = None) -> Attr:
        with self.lock:
            n = self._node(ino)
            if mode is not None:
                n.mode = (n.mode & ~0o7777) | (mode & 0o7777)
            if uid is not None:
                n.uid = uid
            if gid is not None:
                n.gid = gid
            now = time.time_ns()
            if stat.S_ISREG(n.mode):
                if size is not None:
                    os.truncate(self.path(ino), size)
                if atime_ns is not None or mtime_ns is not None:
                    st = os.stat(self.path(ino))
                    a = now if atime_ns == UTIME_NOW else (atime_ns or st.st_atime_ns)
                    m = now if mtime_ns == UTIME_NOW else (mtime_ns or st.st_mtime_ns)
                    os.utime(self.path(ino), ns=(a, m))
            else:
                if atime_ns is not None:
                    n.atime_ns = now if atime_ns == UTIME_NOW else atime_ns
                if mtime_ns is not None:
                    n.mtime_ns = now if mtime_ns == UTIME_NOW else mtime_ns
            n.ctime_ns = now
            return self._attr(n)

    def statfs(self) -> StatFs:
        s = os.statvfs(self.backing_dir)
        return StatFs(s.f_bsize, s.f_frsize, s.f_blocks, s.f_bfree, s.f_bavail, s.f_files,
                      s.f_ffree, 255)

    def getxattr(self, ino: int, name: bytes) -> bytes:
        with self.lock:
            n = self._node(ino)
            if name == STATE_XATTR and stat.S_ISREG(n.mode):
                return b"dirty"
            try:
                return n.xattrs[name]
            except KeyError:
                raise FsError(errno.ENODATA) from None

    def listxattr(self, ino: int) -> list[bytes]:
        with self.lock:
            n = self._node(ino)
            return ([STATE_XATTR] if stat.S_ISREG(n.mode) else []) + list(n.xattrs)

    def setxattr(self, ino: int, name: bytes, value: bytes, flags: int) -> None:
        with self.lock:
            n = self._node(ino)
            if name == STATE_XATTR:
                raise FsError(errno.EPERM)
            if flags & XATTR_CREATE and name in n.xattrs:
                raise FsError(errno.EEXIST)
            if flags & XATTR_REPLACE and name not in n.xattrs:
                raise FsError(errno.ENODATA)
            n.xattrs[name] = bytes(value)

    def removexattr(self, ino: int, name: bytes) -> None:
        with self.lock:
            if self._node(ino).xattrs.pop(name, None) is None:
                raise FsError(errno.ENODATA)

    # --- files -----------------------------------------------------------------------------

    def open(self, ino: int, flags: int, ctx: Ctx, same_file: bool = False) -> int:
        with self.lock:
            n = self._node(ino)
            if n.children is not None:
                raise FsError(errno.EISDIR)
            writable = (flags & os.O_ACCMODE) != os.O_RDONLY
            if self.cow_on_write and writable and any(h.ino == ino
                                                      for h in self.handles.values()):
                old = self.path(ino)
                n.gen += 1
                shutil.copyfile(old, self.path(ino))
            fd = os.open(self.path(ino), os.O_RDWR)
            if flags & os.O_TRUNC:
                os.ftruncate(fd, 0)
            fh = self.next_fh
            self.next_fh += 1
            self.handles[fh] = Handle(ino, fd, flags)
            self.calls["open"] += 1
            return fh

    def _handle(self, fh: int) -> Handle:
        try:
            return self.handles[fh]
        except KeyError:
            self.violations.append(f"unknown fh {fh}")
            raise FsError(errno.EBADF) from None

    def passthrough_fd(self, fh: int, opening: bool = False) -> int | None:
        h = self._handle(fh)
        if not self.passthrough or h.ino in self.remote_inos:
            return None
        return h.fd

    def read(self, fh: int, offset: int, size: int) -> bytes:
        return os.pread(self._handle(fh).fd, size, offset)

    def write(self, fh: int, offset: int, data) -> int:
        return os.pwrite(self._handle(fh).fd, data, offset)

    def flush(self, fh: int, unique: int = 0) -> None:
        self._handle(fh)
        self.calls["flush"] += 1

    def release(self, fh: int) -> None:
        with self.lock:
            h = self.handles.pop(fh, None)
            if h is None:
                self.violations.append(f"release of unknown fh {fh}")
                return
            os.close(h.fd)
            self.calls["release"] += 1
            self._drop(h.ino)

    def fsync(self, fh: int, datasync: bool) -> None:
        fd = self._handle(fh).fd
        (os.fdatasync if datasync else os.fsync)(fd)
        self.calls["fdatasync" if datasync else "fsync"] += 1

    # --- directories -----------------------------------------------------------------------

    def opendir(self, ino: int, ctx: Ctx) -> int:
        with self.lock:
            self._dir(ino)
            fh = self.next_fh
            self.next_fh += 1
            self.dirs[fh] = (ino, [])
            return fh

    def readdir(self, fh: int, offset: int) -> list[tuple[bytes, Attr, int]]:
        with self.lock:
            ino = self.dirs[fh][0]
            items = sorted(self._dir(ino).children.items())
            return [(name, self._attr(self.nodes[child]), i + 1)
                    for i, (name, child) in enumerate(items) if i >= offset]

    def releasedir(self, fh: int) -> None:
        with self.lock:
            if self.dirs.pop(fh, None) is None:
                self.violations.append(f"releasedir of unknown fh {fh}")


# --- unit tests of the wire helpers (no mount needed) ---------------------------------------

def test_struct_sizes_match_the_kernel_header():
    assert proto.IN_HEADER.size == 40
    assert proto.OUT_HEADER.size == 16
    assert proto.ATTR.size == 88
    assert len(proto.pack_entry(None, 1, 1)) == 128
    assert proto.INIT_OUT.size == 64
    assert proto.OPEN_OUT.size == 16
    assert proto.KSTATFS.size == 80
    assert proto.SETATTR_IN.size == 88
    assert proto.READ_IN.size == 40
    assert proto.DEV_IOC_BACKING_OPEN == 0x4010E501
    assert proto.DEV_IOC_BACKING_CLOSE == 0x4004E502


def test_negotiate_init_asks_passthrough_never_with_writeback():
    kflags = proto.ASYNC_READ | proto.MAX_PAGES | proto.INIT_EXT | proto.WRITEBACK_CACHE
    req = proto.INIT_IN.pack(7, 44, 1 << 17, kflags & 0xFFFFFFFF,
                             (proto.PASSTHROUGH | kflags) >> 32)
    reply, res = proto.negotiate_init(req, passthrough=True, max_stack_depth=2)
    assert res.passthrough and res.max_stack_depth == 2 and res.minor == 40
    fields = proto.INIT_OUT.unpack(reply)
    assert fields[1] == 40
    assert not fields[3] & proto.WRITEBACK_CACHE
    assert fields[10] == proto.PASSTHROUGH >> 32 and fields[11] == 2
    assert fields[6] == 1 << 20 and fields[8] == 256
    # an old kernel (7.38) offers no passthrough
    req = proto.INIT_IN.pack(7, 38, 1 << 17, kflags & 0xFFFFFFFF, 0)
    _, res = proto.negotiate_init(req, passthrough=True, max_stack_depth=1)
    assert not res.passthrough


def test_pack_dirent_is_aligned():
    rec = proto.pack_dirent(5, 3, b"abc", stat.S_IFREG)
    assert len(rec) % 8 == 0
    ino, off, namelen, typ = struct.unpack_from("<QQII", rec)
    assert (ino, off, namelen, typ) == (5, 3, 3, stat.S_IFREG >> 12)


def test_negative_times_pack():
    a = Attr(2, stat.S_IFREG | 0o644, 1, 0, 0, 0, -1_500_000_000, 0, 0)
    fields = proto.ATTR.unpack(proto.pack_attr(a))
    assert fields[3] == -2 and fields[6] == 500_000_000
