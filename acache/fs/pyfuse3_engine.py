"""The pyfuse3 mount engine: a thin adapter from pyfuse3 Operations to the VFS.

Each handler calls the VFS in a worker thread (never blocking the trio loop)
and translates errors at this one edge: FsError -> FUSEError(errno); anything
else is logged and answered EIO (any other exception would tear the mount down).
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import subprocess
import threading
import time

import pyfuse3
import trio

from acache.errors import FsError
from acache.fs import pyfuse3_loop
from acache.fs.opstats import OpStats
from acache.fs.types import STATE_XATTR, Attr, Ctx

log = logging.getLogger("acache.fs.pyfuse3")
_DISK_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})


def _entry(a: Attr, timeout: float = 1.0) -> pyfuse3.EntryAttributes:
    e = pyfuse3.EntryAttributes()
    e.st_ino = a.ino
    e.generation = a.generation
    e.entry_timeout = timeout
    e.attr_timeout = timeout
    e.st_mode = a.mode
    e.st_nlink = a.nlink
    e.st_uid = a.uid
    e.st_gid = a.gid
    e.st_rdev = a.rdev
    e.st_size = a.size
    e.st_blksize = a.blksize
    e.st_blocks = a.blocks
    e.st_atime_ns = a.atime_ns
    e.st_mtime_ns = a.mtime_ns
    e.st_ctime_ns = a.ctime_ns
    return e


def _ctx(ctx) -> Ctx:
    return Ctx(uid=ctx.uid, gid=ctx.gid, pid=ctx.pid, umask=ctx.umask) if ctx is not None else Ctx()


class Ops(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(self, vfs) -> None:
        super().__init__()
        self.vfs = vfs
        self.limiter = trio.CapacityLimiter(32)
        # requests by kind with their latency: every handler runs on the one trio thread
        self.stats = OpStats(dict(enumerate(TIMED_OPS)))
        self._record = self.stats.shard().record
        # optional VFS fast paths (answers from memory, on the trio thread: a thread hop
        # costs more than the lookup)
        self._lookup_fast = vfs.lookup_fast
        self._getattr_fast = vfs.getattr_fast

    @staticmethod
    def _inline(fn, *args):
        """A VFS fast path run on the trio thread (it never blocks): its answer, or None
        when the caller must take the worker-thread path (also after an unexpected error,
        which that path then meets, logs and answers)."""
        if fn is None:
            return None
        try:
            return fn(*args)
        except FsError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        except Exception:
            return None

    async def _call(self, fn, *args, **kw):
        try:
            return await trio.to_thread.run_sync(lambda: fn(*args, **kw), limiter=self.limiter)
        except FsError as e:                  # an answer, not a failure of ours
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s (%s): %s", getattr(fn, "__name__", fn), args[0] if args else "",
                          f"{errno.errorcode.get(e.errno, e.errno)} {e}")
            raise pyfuse3.FUSEError(e.errno) from None
        except OSError as e:
            # EFBIG (past the cache disk's maximum file size) is the caller's doing; a
            # full or read-only cache disk the operator's; anything else is unexpected
            level = (logging.DEBUG if e.errno == errno.EFBIG else logging.WARNING
                     if e.errno in _DISK_ERRORS else logging.ERROR)
            log.log(level, "%s (%s): %s", getattr(fn, "__name__", fn), args[0] if args else "", e)
            await self._after_failure(e)
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except Exception as e:
            log.exception("unexpected error in %s (%s)", getattr(fn, "__name__", fn),
                          args[0] if args else "")
            await self._after_failure(e)
            raise pyfuse3.FUSEError(errno.EIO) from None

    async def _after_failure(self, e: BaseException) -> None:
        """Undo what a failed operation changed in memory without committing it."""
        try:
            await trio.to_thread.run_sync(self.vfs.after_failure, e, limiter=self.limiter)
        except Exception:
            log.exception("undoing what a failed %s changed", type(e).__name__)

    async def lookup(self, parent_inode, name, ctx=None):
        a = self._inline(self._lookup_fast, parent_inode, name)   # memory only: no hop
        if a is not None:
            return _entry(a)
        return _entry(await self._call(self.vfs.lookup, parent_inode, name, _ctx(ctx)))

    async def forget(self, inode_list):
        try:
            self.vfs.forget(inode_list)
        except Exception:
            log.exception("forget")

    async def getattr(self, inode, ctx=None):
        a = self._inline(self._getattr_fast, inode)
        if a is not None:
            return _entry(a)
        return _entry(await self._call(self.vfs.getattr, inode))

    async def setattr(self, inode, attr, fields, fh, ctx):
        kw = {}
        if fields.update_mode:
            kw["mode"] = attr.st_mode
        if fields.update_uid:
            kw["uid"] = attr.st_uid
        if fields.update_gid:
            kw["gid"] = attr.st_gid
        if fields.update_size:
            kw["size"] = attr.st_size
        if fields.update_atime:
            kw["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            kw["mtime_ns"] = attr.st_mtime_ns
        return _entry(await self._call(self.vfs.setattr, inode, _ctx(ctx), fh=fh, **kw))

    async def mkdir(self, parent_inode, name, mode, ctx):
        return _entry(await self._call(self.vfs.mkdir, parent_inode, name, mode, _ctx(ctx)))

    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return _entry(await self._call(self.vfs.mknod, parent_inode, name, mode, rdev, _ctx(ctx)))

    async def create(self, parent_inode, name, mode, flags, ctx):
        fh, attr = await self._call(self.vfs.create, parent_inode, name, mode, flags, _ctx(ctx))
        return pyfuse3.FileInfo(fh=fh), _entry(attr)

    async def open(self, inode, flags, ctx):
        fh = await self._call(self.vfs.open, inode, flags, _ctx(ctx))
        if self.vfs.shared:
            # other hosts change files too (acache.cluster): close-to-open means this open
            # sees their size, so the kernel's cached attributes go (not its pages)
            try:
                await trio.to_thread.run_sync(pyfuse3.invalidate_inode, inode, True,
                                              limiter=self.limiter)
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.ENOSYS):
                    log.warning("dropping the kernel's cached attributes of inode %d: %s", inode, e)
        return pyfuse3.FileInfo(fh=fh)

    async def read(self, fh, off, size):
        try:    # a pread of cached data, mostly from the page cache: inline too
            data = self.vfs.read_fast(fh, off, size)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        if data is not None:
            return data
        return await self._call(self.vfs.read, fh, off, size)

    async def write(self, fh, off, buf):
        try:    # a pwrite into the page cache: cheaper inline than a thread hop
            n = self.vfs.write_fast(fh, off, buf)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        if n is not None:
            return n
        return await self._call(self.vfs.write, fh, off, buf)

    async def flush(self, fh):
        # pyfuse3 hands no request number: 0 (the VFS keys the close's notice by fh)
        self.vfs.close_began(fh, 0)      # never blocks: on the loop, before the worker
        await self._call(self.vfs.flush, fh)

    async def release(self, fh):
        ino = self.vfs.handle_ino(fh)
        await self._call(self.vfs.release, fh)
        if ino is not None and not self.vfs.is_open(ino):
            # Opens do not keep the kernel's page cache (no FOPEN_KEEP_CACHE), so the
            # copy of this file's pages under the mount is dead weight next to the cache
            # file's own: drop it now rather than hold every checkpoint twice in memory.
            trio.lowlevel.spawn_system_task(self._drop_pages, ino)

    async def _drop_pages(self, ino: int) -> None:
        try:    # in a thread: the kernel may wait on page locks of requests we serve
            await trio.to_thread.run_sync(pyfuse3.invalidate_inode, ino, False, limiter=self.limiter)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOSYS):
                log.warning("dropping the kernel's cached pages of inode %d: %s", ino, e)

    async def fsync(self, fh, datasync):
        await self._call(self.vfs.fsync, fh, bool(datasync))

    async def unlink(self, parent_inode, name, ctx):
        await self._call(self.vfs.unlink, parent_inode, name, _ctx(ctx))

    async def rmdir(self, parent_inode, name, ctx):
        await self._call(self.vfs.rmdir, parent_inode, name, _ctx(ctx))

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        await self._call(self.vfs.rename, parent_inode_old, name_old, parent_inode_new, name_new,
                         flags, _ctx(ctx))

    async def link(self, inode, new_parent_inode, new_name, ctx):
        raise pyfuse3.FUSEError(errno.EPERM)

    async def symlink(self, parent_inode, name, target, ctx):
        return _entry(await self._call(self.vfs.symlink, parent_inode, name, target, _ctx(ctx)))

    async def readlink(self, inode, ctx):
        return await self._call(self.vfs.readlink, inode)

    async def opendir(self, inode, ctx):
        return await self._call(self.vfs.opendir, inode, _ctx(ctx))

    async def readdir(self, fh, start_id, token):
        for name, attr, nxt in await self._call(self.vfs.readdir, fh, start_id):
            if not pyfuse3.readdir_reply(token, name, _entry(attr), nxt):
                break
            self.vfs.incref(attr.ino)

    async def releasedir(self, fh):
        await self._call(self.vfs.releasedir, fh)

    async def fsyncdir(self, fh, datasync):
        await self._call(self.vfs.fsyncdir, fh, bool(datasync))

    async def statfs(self, ctx):
        s = await self._call(self.vfs.statfs)
        out = pyfuse3.StatvfsData()
        out.f_bsize, out.f_frsize = s.bsize, s.frsize
        out.f_blocks, out.f_bfree, out.f_bavail = s.blocks, s.bfree, s.bavail
        out.f_files, out.f_ffree, out.f_favail = s.files, s.ffree, s.ffree
        out.f_namemax = s.namemax
        return out

    async def getxattr(self, inode, name, ctx):
        if name != STATE_XATTR:
            # The kernel asks for security.capability before every WRITE (file_remove_privs;
            # libfuse cannot negotiate HANDLE_KILLPRIV_V2): answered here, not in a worker
            # thread, that question would double the cost of each write.
            raise pyfuse3.FUSEError(errno.ENODATA)
        return await self._call(self.vfs.getxattr, inode, name)

    async def listxattr(self, inode, ctx):
        return await self._call(self.vfs.listxattr, inode)

    async def setxattr(self, inode, name, value, ctx):
        await self._call(self.vfs.setxattr, inode, name, value)

    async def removexattr(self, inode, name, ctx):
        await self._call(self.vfs.removexattr, inode, name)

    async def access(self, inode, mode, ctx):
        return True


TIMED_OPS = ("lookup", "forget", "getattr", "setattr", "mkdir", "mknod", "create", "open", "read",
             "write", "flush", "release", "fsync", "unlink", "rmdir", "rename", "link", "symlink",
             "readlink", "opendir", "readdir", "releasedir", "fsyncdir", "statfs", "getxattr",
             "listxattr", "setxattr", "removexattr", "access")


def _timed(op: int, fn):
    clock = time.perf_counter_ns

    @functools.wraps(fn)
    async def handler(self, *args, **kw):
        t0 = clock()
        try:
            return await fn(self, *args, **kw)
        finally:
            self._record(op, clock() - t0)
    return handler


for _i, _name in enumerate(TIMED_OPS):
    setattr(Ops, _name, _timed(_i, getattr(Ops, _name)))


def force_unmount(mountpoint: str) -> bool:
    """Detach ``mountpoint`` lazily: an argument list, never a shell (a path may hold
    quotes, spaces or ``$(...)``).  False when neither umount nor fusermount3 did it."""
    for argv in (["umount", "-l", "--", mountpoint], ["fusermount3", "-u", "-z", "--", mountpoint]):
        try:
            if subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=30, check=False).returncode == 0:
                return True
        except (OSError, subprocess.TimeoutExpired):
            continue
    return False


class Pyfuse3Engine:
    """Runs pyfuse3's trio loop in a thread of the node process."""

    passthrough_active = False
    stop_timeout = 10.0     # seconds for the loop to end before the mount is detached

    def __init__(self, vfs, mountpoint: str, *, fsname: str = "acache") -> None:
        self.vfs, self.mountpoint, self.fsname = vfs, mountpoint, fsname
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._done = threading.Event()
        self.ops: Ops | None = None

    def start(self) -> None:
        if not os.access("/dev/fuse", os.R_OK | os.W_OK):
            # libfuse opens it itself before it would try fusermount3
            from acache.errors import ConfigError
            raise ConfigError(f"/dev/fuse is not readable and writable by uid {os.geteuid()} "
                              "(most distributions make it 0666; here: "
                              f"{oct(os.stat('/dev/fuse').st_mode & 0o777) if os.path.exists('/dev/fuse') else 'missing'})"
                              "; run as root, or `chmod 0666 /dev/fuse`")
        opts = set(pyfuse3.default_options)
        opts.discard("default_permissions")
        opts |= {f"fsname={self.fsname}", "subtype=acache", "default_permissions"}
        if os.geteuid() == 0 or _user_allow_other():
            # other users see the mount (root's node serves every user's job); fusermount3
            # refuses the option to a normal user unless /etc/fuse.conf says user_allow_other
            opts.add("allow_other")
        self.ops = Ops(self.vfs)
        pyfuse3_loop.init(self.ops, self.mountpoint, opts)
        self._thread = threading.Thread(target=self._run, name="acache-pyfuse3", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error:
            raise self._error

    def _run(self) -> None:
        async def main():
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await pyfuse3.main(min_tasks=4, max_tasks=64)
        try:
            trio.run(main)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            self._error = e
            log.exception("the pyfuse3 loop ended with an error")
        finally:
            self._ready.set()
            try:
                pyfuse3.close(unmount=True)
            except Exception:
                pass
            self._done.set()

    def stop(self) -> None:
        if self._done.is_set() or self._token is None:
            return
        try:
            trio.from_thread.run_sync(pyfuse3.terminate, trio_token=self._token)
        except Exception:
            pass
        self._done.wait(self.stop_timeout)
        if not self._done.is_set() and not force_unmount(self.mountpoint):
            log.warning("could not detach %s", self.mountpoint)

    def wait(self) -> None:
        self._done.wait()

    def op_stats(self) -> OpStats | None:
        return self.ops.stats if self.ops is not None else None

    def op_counts(self) -> dict[str, int]:
        stats = self.op_stats()
        return {name: sum(c) for name, (c, _) in stats.snapshot().items()} if stats else {}


def _user_allow_other() -> bool:
    try:
        with open("/etc/fuse.conf") as f:
            return any(line.split("#")[0].strip() == "user_allow_other" for line in f)
    except OSError:
        return False
