"""FUSE request handlers: decode the request, call the VFS, encode the reply.

Each handler is a few lines; errors are translated by the session.  Bookkeeping that the
kernel protocol needs and the VFS does not know about (per-inode io mode and backing ids,
whether an inode may be open for writing, readdir continuation) lives in ``OpenTable``
and here; lookup counts and handles live in the VFS.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from typing import Callable

from acache.errors import FsError, NewFile
from acache.fs.overlap import Overlap
from acache.fs.native import proto
from acache.fs.native.passthrough import OpenTable
from acache.fs.native.session import NO_REPLY, Reply, Request
from acache.fs.types import RENAME_EXCHANGE, RENAME_NOREPLACE, UTIME_NOW, Attr

log = logging.getLogger("acache.fs.native")


# SETATTR valid bits that change no attribute: the handle, the lock owner, ctime
_SETATTR_NOTHING = proto.FATTR_FH | proto.FATTR_LOCKOWNER | proto.FATTR_CTIME
CREATED_ATTR_VALID = 0.01   # s: the attributes of a file CREATE just made (the mtime granularity
                            # of ext4 is a jiffy, 1-10 ms)


def _name(body: memoryview) -> bytes:
    data = bytes(body)
    end = data.find(b"\0")
    return data if end < 0 else data[:end]


def _writable(flags: int) -> bool:
    return (flags & os.O_ACCMODE) != os.O_RDONLY or bool(flags & os.O_TRUNC)


class Ops:
    def __init__(self, vfs, table: OpenTable, *, entry_timeout: float = 1.0,
                 attr_timeout: float = 1.0):
        self.vfs = vfs
        self.table = table
        self.entry_timeout = entry_timeout
        self.attr_timeout = attr_timeout
        # a namespace other hosts change too (acache.cluster): no kept directory listings,
        # attributes dropped at every open (acache.fs.api: what a VFS offers)
        self.shared = bool(vfs.shared)
        self.inval_attr: Callable[[int], None] | None = None
        # set by the engine: the kernel's pages of an inode dropped
        self.drop_pages: Callable[[int], None] | None = None
        # closes that overlapped in time may commit in parallel (acache.fs.overlap); one
        # host's journal only (a cluster's head orders the closes it is sent)
        self.overlap = Overlap() if vfs.ordered_closes and not self.shared else None
        self._dirs: dict[int, tuple[int, list]] = {}        # fh -> (next vfs offset, rest)
        self._dirs_lock = threading.Lock()
        self._open_dirs: set[int] = set()
        p = proto
        self.handlers = {
            p.LOOKUP: self.lookup, p.FORGET: self.forget, p.BATCH_FORGET: self.batch_forget,
            p.GETATTR: self.getattr, p.SETATTR: self.setattr, p.MKDIR: self.mkdir,
            p.MKNOD: self.mknod, p.CREATE: self.create, p.OPEN: self.open, p.READ: self.read,
            p.WRITE: self.write, p.FLUSH: self.flush, p.RELEASE: self.release,
            p.FSYNC: self.fsync, p.OPENDIR: self.opendir, p.READDIR: self.readdir,
            p.READDIRPLUS: self.readdirplus, p.RELEASEDIR: self.releasedir,
            p.FSYNCDIR: self.fsyncdir, p.UNLINK: self.unlink, p.RMDIR: self.rmdir,
            p.RENAME: self.rename, p.RENAME2: self.rename2, p.STATFS: self.statfs,
            p.GETXATTR: self.getxattr, p.LISTXATTR: self.listxattr,
            p.SETXATTR: self.setxattr, p.REMOVEXATTR: self.removexattr,
            p.ACCESS: self.access, p.FALLOCATE: self.fallocate, p.DESTROY: self.destroy,
            p.NOTIFY_REPLY: lambda req: NO_REPLY,     # we send no retrieve requests
            p.IOCTL: self._error(errno.ENOTTY), p.SYMLINK: self.symlink,
            p.LINK: self._error(errno.EPERM), p.READLINK: self.readlink,
            # LSEEK, POLL, BMAP, COPY_FILE_RANGE, STATX, TMPFILE, ...: ENOSYS (no handler)
        }

    @staticmethod
    def _error(err: int):
        def handler(req: Request):
            raise FsError(err)
        return handler

    # --- helpers ---------------------------------------------------------------------------

    def _attr_valid(self, a: Attr) -> float:
        # A file open for writing changes size underneath us (passthrough writes go
        # straight to the cache file): never let the kernel cache its attributes.
        if stat.S_ISREG(a.mode) and self.table.may_be_writing(a.ino):
            return 0.0
        return self.attr_timeout

    def _entry(self, a: Attr) -> bytes:
        return proto.pack_entry(a, self.entry_timeout, self._attr_valid(a))

    def _forget_one(self, ino: int):
        return lambda: self.vfs.forget([(ino, 1)])

    def _open_reply(self, ino: int, fh: int, flags: int) -> bytes:
        writable = _writable(flags)
        open_flags, backing_id = self.table.open(ino, fh, writable,
                                                 lambda: self.vfs.passthrough_fd(fh, True),
                                                 lambda: self.vfs.backing_fd(fh))
        if not writable:
            # the FLUSH of a read-only handle does nothing (only a writer's close journals):
            # one round trip less per open + close
            open_flags |= proto.FOPEN_NOFLUSH
        return proto.OPEN_OUT.pack(fh, open_flags, backing_id)

    def _kill_suidgid(self, ino: int, req: Request, fh: int | None = None) -> None:
        """HANDLE_KILLPRIV_V2 (negotiated because it spares a GETXATTR round trip per
        write): the kernel leaves dropping setuid/setgid on write, truncate and chown to
        us (it flags only callers without CAP_FSETID)."""
        a = self.vfs.getattr(ino, fh)
        if stat.S_ISDIR(a.mode):
            return
        kill = stat.S_ISUID | (stat.S_ISGID if a.mode & stat.S_IXGRP else 0)
        if a.mode & kill:
            self.vfs.setattr(ino, req.ctx(), fh=fh, mode=a.mode & ~kill)

    def _undo_open(self, fh: int, ino: int | None = None):
        def undo():
            self.table.release(fh)
            self.vfs.release(fh)
            if ino is not None:
                self.vfs.forget([(ino, 1)])
        return undo

    # --- names -----------------------------------------------------------------------------

    def lookup(self, req: Request):
        try:
            a = self.vfs.lookup(req.nodeid, _name(req.body), req.ctx())
        except FsError as e:
            if e.errno != errno.ENOENT or self.shared:
                raise
            # A name that does not exist stays missing until it is created through this
            # mount (the parent's under-storage entries are merged before any lookup in it
            # answers): the kernel may keep the miss as long as a name (nodeid 0, no lookup
            # count), which spares the LOOKUP before each create, mkdir and rename to a new
            # name.  Not where other hosts change the namespace (acache.cluster).
            return proto.pack_entry(None, self.entry_timeout, 0.0)
        return Reply(self._entry(a), self._forget_one(a.ino))

    def forget(self, req: Request):
        self.vfs.forget([(req.nodeid, proto.FORGET_IN.unpack_from(req.body)[0])])
        return NO_REPLY

    def batch_forget(self, req: Request):
        count = proto.BATCH_FORGET_IN.unpack_from(req.body)[0]
        off = proto.BATCH_FORGET_IN.size
        items = [proto.FORGET_ONE.unpack_from(req.body, off + i * proto.FORGET_ONE.size)
                 for i in range(count)]
        if items:
            self.vfs.forget(items)
        return NO_REPLY

    def mkdir(self, req: Request):
        mode, umask = proto.MKDIR_IN.unpack_from(req.body)
        name = _name(req.body[proto.MKDIR_IN.size:])
        a = self.vfs.mkdir(req.nodeid, name, mode, req.ctx(umask))
        return Reply(self._entry(a), self._forget_one(a.ino))

    def mknod(self, req: Request):
        mode, _rdev, umask, _ = proto.MKNOD_IN.unpack_from(req.body)
        if not stat.S_ISREG(mode):
            raise FsError(errno.EPERM)
        name = _name(req.body[proto.MKNOD_IN.size:])
        a = self.vfs.mknod(req.nodeid, name, mode, _rdev, req.ctx(umask))
        return Reply(self._entry(a), self._forget_one(a.ino))

    def symlink(self, req: Request):
        name, target = proto.split_names(req.body, 2)   # FUSE_SYMLINK: name, then target
        a = self.vfs.symlink(req.nodeid, name, target, req.ctx())
        return Reply(self._entry(a), self._forget_one(a.ino))

    def readlink(self, req: Request):
        return self.vfs.readlink(req.nodeid)

    def unlink(self, req: Request):
        self.vfs.unlink(req.nodeid, _name(req.body), req.ctx())
        return b""

    def rmdir(self, req: Request):
        self.vfs.rmdir(req.nodeid, _name(req.body), req.ctx())
        return b""

    def _rename(self, req: Request, newdir: int, flags: int, names: memoryview):
        old, new = proto.split_names(names, 2)
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE):
            raise FsError(errno.EINVAL)          # RENAME_WHITEOUT and the unknown
        self.vfs.rename(req.nodeid, old, newdir, new, flags, req.ctx())
        return b""

    def rename(self, req: Request):
        newdir = proto.RENAME_IN.unpack_from(req.body)[0]
        return self._rename(req, newdir, 0, req.body[proto.RENAME_IN.size:])

    def rename2(self, req: Request):
        newdir, flags, _ = proto.RENAME2_IN.unpack_from(req.body)
        return self._rename(req, newdir, flags, req.body[proto.RENAME2_IN.size:])

    # --- attributes ------------------------------------------------------------------------

    def getattr(self, req: Request):
        flags, _, fh = proto.GETATTR_IN.unpack_from(req.body)
        a = self.vfs.getattr(req.nodeid, fh if flags & proto.GETATTR_FH else None)
        return proto.pack_attr_out(a, self._attr_valid(a))

    def setattr(self, req: Request):
        (valid, _, fh, size, _lock, atime, mtime, _ctime, atimens, mtimens, _ctimens,
         mode, _, uid, gid, _) = proto.SETATTR_IN.unpack_from(req.body)
        kw = {}
        if valid & proto.FATTR_MODE:
            kw["mode"] = mode
        elif valid & proto.FATTR_KILL_SUIDGID or not valid & ~_SETATTR_NOTHING:
            # A SETATTR that changes nothing is how the kernel passes on a chown(f, -1,
            # -1) or an unprivileged write's privilege drop under HANDLE_KILLPRIV_V2.
            self._kill_suidgid(req.nodeid, req, fh if valid & proto.FATTR_FH else None)
        if valid & proto.FATTR_UID:
            kw["uid"] = uid
        if valid & proto.FATTR_GID:
            kw["gid"] = gid
        if valid & proto.FATTR_SIZE:
            kw["size"] = size
        if valid & proto.FATTR_ATIME_NOW:
            kw["atime_ns"] = UTIME_NOW
        elif valid & proto.FATTR_ATIME:
            kw["atime_ns"] = atime * 1_000_000_000 + atimens
        if valid & proto.FATTR_MTIME_NOW:
            kw["mtime_ns"] = UTIME_NOW
        elif valid & proto.FATTR_MTIME:
            kw["mtime_ns"] = mtime * 1_000_000_000 + mtimens
        a = self.vfs.setattr(req.nodeid, req.ctx(),
                             fh=fh if valid & proto.FATTR_FH else None, **kw)
        return proto.pack_attr_out(a, self._attr_valid(a))

    def statfs(self, req: Request):
        return proto.pack_statfs(self.vfs.statfs())

    def access(self, req: Request):
        return b""           # default_permissions: the kernel checks modes itself

    # --- xattrs ----------------------------------------------------------------------------

    @staticmethod
    def _sized(data: bytes, size: int):
        if size == 0:
            return proto.GETXATTR_OUT.pack(len(data), 0)
        if len(data) > size:
            raise FsError(errno.ERANGE)
        return data

    def getxattr(self, req: Request):
        size = proto.GETXATTR_IN.unpack_from(req.body)[0]
        name = _name(req.body[proto.GETXATTR_IN.size:])
        return self._sized(self.vfs.getxattr(req.nodeid, name), size)

    def listxattr(self, req: Request):
        size = proto.GETXATTR_IN.unpack_from(req.body)[0]
        names = self.vfs.listxattr(req.nodeid)
        return self._sized(b"".join(n + b"\0" for n in names), size)

    def setxattr(self, req: Request):
        size, flags = proto.SETXATTR_IN.unpack_from(req.body)
        rest = bytes(req.body[proto.SETXATTR_IN.size:])
        end = rest.index(b"\0")
        self.vfs.setxattr(req.nodeid, rest[:end], rest[end + 1:end + 1 + size], flags)
        return b""

    def removexattr(self, req: Request):
        self.vfs.removexattr(req.nodeid, _name(req.body))
        return b""

    # --- files -----------------------------------------------------------------------------

    def create(self, req: Request):
        flags, mode, umask, _ = proto.CREATE_IN.unpack_from(req.body)
        name = _name(req.body[proto.CREATE_IN.size:])
        fh, a = self.vfs.create(req.nodeid, name, mode, flags, req.ctx(umask))
        try:
            open_out = self._open_reply(a.ino, fh, flags)
        except BaseException:
            self._undo_open(fh, a.ino)()
            raise
        # Its attributes hold for a few ms, not 0 as for other files open for writing: that
        # spares the GETATTR the kernel sends right after every CREATE, and the kernel keeps
        # size and times itself for writes through it (passthrough or not)
        entry = proto.pack_entry(a, self.entry_timeout, min(CREATED_ATTR_VALID, self.attr_timeout))
        return Reply([entry, open_out], self._undo_open(fh, a.ino))

    def open(self, req: Request):
        flags, open_flags = proto.OPEN_IN.unpack_from(req.body)
        fh = self._open(req, flags)
        if self.shared and self.inval_attr is not None:
            # another host may have changed the file since the kernel cached its size:
            # close-to-open means this open must see it (a read past a stale size is cut)
            self.inval_attr(req.nodeid)
        try:
            # Under passthrough we never see the writes that should drop setuid/setgid
            # (HANDLE_KILLPRIV_V2 leaves that to us), so an unprivileged write open does.
            if open_flags & proto.OPEN_KILL_SUIDGID or (req.uid != 0 and _writable(flags)):
                self._kill_suidgid(req.nodeid, req, fh)
            out = self._open_reply(req.nodeid, fh, flags)
        except BaseException:
            self._undo_open(fh)()
            raise
        return Reply(out, self._undo_open(fh))

    def _open(self, req: Request, flags: int) -> int:
        """vfs.open, but a write open of a file that readers hold passed through to its
        generation (the kernel allows one backing file per inode) must not move to a new
        generation's file: it waits for those readers first (then EBUSY), before anything
        changed -- refused after the open, an O_TRUNC would have emptied the file."""
        if _writable(flags) and self.table.held_by_readers(req.nodeid):
            try:
                return self.vfs.open(req.nodeid, flags, req.ctx(), same_file=True)
            except NewFile:
                self.table.wait_readers(req.nodeid)
        return self.vfs.open(req.nodeid, flags, req.ctx())

    def read(self, req: Request):
        fh, offset, size = proto.READ_IN.unpack_from(req.body)[:3]
        return self.vfs.read(fh, offset, size)

    def write(self, req: Request):
        fh, offset, size, write_flags = proto.WRITE_IN.unpack_from(req.body)[:4]
        start = proto.WRITE_IN.size
        n = self.vfs.write(fh, offset, req.body[start:start + size])
        if write_flags & proto.WRITE_KILL_SUIDGID:
            self._kill_suidgid(req.nodeid, req, fh)
        return proto.WRITE_OUT.pack(n, 0)

    def flush(self, req: Request):
        fh = proto.FLUSH_IN.unpack_from(req.body)[0]
        if self.overlap is None:
            self.vfs.flush(fh, req.unique)
            return b""
        meta = self.vfs.meta     # which closes this one overlapped: by request number
        try:
            with meta.op(self.overlap.floor(req.unique)):
                self.vfs.flush(fh)
        finally:
            self.overlap.replied(meta.last_seq())   # before the reply, even an error's
        return b""

    def flush_read(self, req: Request) -> None:
        """The reader thread read a FLUSH (before any worker runs it): a shared namespace's
        head hears at once that this close began (close_began)."""
        self.vfs.close_began(proto.FLUSH_IN.unpack_from(req.body)[0], req.unique)

    def release(self, req: Request):
        fh = proto.RELEASE_IN.unpack_from(req.body)[0]
        served = not self.table.is_passthrough(fh)
        ino = self.vfs.handle_ino(fh)
        try:
            self.vfs.release(fh)
        finally:
            self.table.release(fh)
        if served and ino is not None and self.drop_pages is not None \
                and not self.vfs.is_open(ino):
            # opens never keep the kernel's page cache (no KEEP_CACHE): the pages the
            # daemon served are dead weight next to the cache file's own; drop them now
            self.drop_pages(ino)
        return b""

    def fsync(self, req: Request):
        fh, flags, _ = proto.FSYNC_IN.unpack_from(req.body)
        self.vfs.fsync(fh, bool(flags & proto.FSYNC_FDATASYNC))
        return b""

    def fallocate(self, req: Request):
        """Done by the VFS on the cache file (the kernel does not pass fallocate through),
        for any open for writing.  What it does not do is EOPNOTSUPP, never ENOSYS: that
        would disable fallocate for the whole mount."""
        fh, offset, length, mode, _ = proto.FALLOCATE_IN.unpack_from(req.body)
        self.vfs.fallocate(fh, mode, offset, length)
        return b""

    # --- directories -----------------------------------------------------------------------

    def opendir(self, req: Request):
        fh = self.vfs.opendir(req.nodeid, req.ctx())
        with self._dirs_lock:
            self._open_dirs.add(fh)

        def undo():
            with self._dirs_lock:
                self._open_dirs.discard(fh)
            self.vfs.releasedir(fh)
        # The kernel may keep the listing across opens: every change of a directory's
        # entries comes through the kernel (which then drops it) or, for a directory's
        # under-storage entries, before its first listing (opendir merges them)
        # (not in a cluster: other hosts change directories behind this kernel's back)
        keep = 0 if self.shared else proto.FOPEN_CACHE_DIR | proto.FOPEN_KEEP_CACHE
        return Reply(proto.OPEN_OUT.pack(fh, keep, 0), undo)

    def releasedir(self, req: Request):
        fh = proto.RELEASE_IN.unpack_from(req.body)[0]
        with self._dirs_lock:
            self._dirs.pop(fh, None)
            self._open_dirs.discard(fh)
        self.vfs.releasedir(fh)
        return b""

    def fsyncdir(self, req: Request):
        fh, flags, _ = proto.FSYNC_IN.unpack_from(req.body)
        self.vfs.fsyncdir(fh, bool(flags & proto.FSYNC_FDATASYNC))
        return b""

    def _listing(self, req: Request):
        """(name, attr|None, ino, mode, cookie) from the request's offset.  Cookies 1 and
        2 are '.' and '..'; a VFS offset o is cookie o + 2."""
        fh, offset, size = proto.READ_IN.unpack_from(req.body)[:3]
        dots = []
        if offset == 0:
            dots.append((b".", None, req.nodeid, stat.S_IFDIR, 1))
        if offset <= 1:
            dots.append((b"..", None, req.nodeid, stat.S_IFDIR, 2))
        voff = max(offset - 2, 0)
        with self._dirs_lock:
            cached = self._dirs.get(fh)
        if cached is not None and cached[0] == voff and voff != 0:
            entries = cached[1]
        else:
            entries = self.vfs.readdir(fh, voff)
        return fh, size, dots, entries

    def _remember(self, fh: int, entries: list, used: int) -> None:
        if used:
            with self._dirs_lock:
                self._dirs[fh] = (entries[used - 1][2], entries[used:])

    def readdir(self, req: Request):
        """Whole entries that fit in the size the kernel asked for, as one buffer (one
        iovec per entry would exceed IOV_MAX on a big directory)."""
        fh, size, dots, entries = self._listing(req)
        out = bytearray()
        for name, _a, ino, mode, cookie in dots:
            rec = proto.pack_dirent(ino, cookie, name, mode)
            if len(out) + len(rec) > size:
                return bytes(out)
            out += rec
        used = 0
        for name, a, next_off in entries:
            rec = proto.pack_dirent(a.ino, next_off + 2, name, a.mode)
            if len(out) + len(rec) > size:
                break
            out += rec
            used += 1
        self._remember(fh, entries, used)
        return bytes(out)

    def readdirplus(self, req: Request):
        """Like readdir; every entry sent hands the kernel one lookup reference (taken
        back if the reply is not delivered)."""
        fh, size, dots, entries = self._listing(req)
        out = bytearray()
        for name, _a, ino, mode, cookie in dots:
            rec = proto.pack_entry(None, 0, 0) + proto.pack_dirent(ino, cookie, name, mode)
            if len(out) + len(rec) > size:
                return bytes(out)
            out += rec
        given: list[tuple[int, int]] = []
        try:
            for name, a, next_off in entries:
                rec = self._entry(a) + proto.pack_dirent(a.ino, next_off + 2, name, a.mode)
                if len(out) + len(rec) > size:
                    break
                self.vfs.incref(a.ino)          # the kernel takes a lookup reference
                given.append((a.ino, 1))
                out += rec
        except BaseException:
            if given:
                self.vfs.forget(given)
            raise
        self._remember(fh, entries, len(given))
        return Reply(bytes(out), (lambda: self.vfs.forget(given)) if given else None)

    def destroy(self, req: Request):
        return b""

    # --- shutdown --------------------------------------------------------------------------

    def release_all(self) -> None:
        """The connection is gone: release what the kernel will never RELEASE now (as if
        the processes holding them had been killed: their close persists what they wrote)."""
        handles = self.table.open_handles()
        if handles:
            log.warning("FUSE connection ended with %d open files; releasing them",
                        len(handles))
        for fh in handles:
            try:
                self.vfs.release(fh)
            except Exception:
                pass
            self.table.release(fh)
        with self._dirs_lock:
            dirs = list(self._open_dirs)
            self._open_dirs.clear()
            self._dirs.clear()
        for fh in dirs:
            try:
                self.vfs.releasedir(fh)
            except Exception:
                pass
