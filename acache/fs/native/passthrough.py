"""Kernel FUSE passthrough: backing ids, the per-inode io mode, and the capability probe.

Rules the kernel enforces (fs/fuse/iomode.c), which shape ``OpenTable``:

- all passthrough opens of one inode must name the *same* backing (another id: EBUSY);
- while an inode has a passthrough open, every new open must be passthrough too, and while
  it has a page-cache (daemon-served) open, a passthrough open fails (ETXTBSY); the kernel
  turns both into EIO for the opener;
- FOPEN_PASSTHROUGH never goes with FOPEN_KEEP_CACHE (EIO);
- BACKING_OPEN needs CAP_SYS_ADMIN and a connection that negotiated passthrough (EPERM),
  and the backing file's stacking depth below max_stack_depth (ELOOP).

The kernel drops its side of an open at close(2), before RELEASE reaches us, so our counts
are never below the kernel's: reusing the backing id while our count is > 0 is always valid.

One inode, one backing *file*: when the VFS hands a different cache file for an inode
(a new generation, opened for writing while the old one is being persisted) and the old
one is still passed through, the new open can be neither passthrough (other backing:
EBUSY) nor daemon-served (the inode is in passthrough mode).  We wait a little for the
old opens to be released (usually a RELEASE still in flight) and otherwise refuse the
open with EBUSY rather than write into the old generation.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import struct
import tempfile
import threading
from dataclasses import dataclass
from typing import Callable

from acache.errors import FsError
from acache.fs.native import mount as _mount
from acache.fs.native import proto

log = logging.getLogger("acache.fs.native")

CAP_SYS_ADMIN = 21
STACKED_FS_MAGIC = {
    0x794C7630: "overlayfs",
    0xF15F: "ecryptfs",
    0x65735546: "fuse",
}


def backing_open(devfd: int, fd: int) -> int:
    """Register ``fd`` with the kernel; returns the backing id (raises OSError)."""
    arg = bytearray(proto.BACKING_MAP.pack(fd, 0, 0))
    return fcntl.ioctl(devfd, proto.DEV_IOC_BACKING_OPEN, arg, True)


def backing_close(devfd: int, backing_id: int) -> None:
    arg = bytearray(struct.pack("<I", backing_id))
    fcntl.ioctl(devfd, proto.DEV_IOC_BACKING_CLOSE, arg, True)


def connection_has_passthrough(devfd: int) -> bool:
    """Did INIT really enable passthrough?  The kernel may silently refuse it (e.g. when
    the writeback cache was also asked for).  BACKING_OPEN of fd -1 answers without side
    effects: EPERM when passthrough is off, EBADF when it is on."""
    try:
        backing_close(devfd, backing_open(devfd, -1))
    except OSError as e:
        return e.errno == errno.EBADF
    return True


@dataclass
class _InodeIO:
    backing_id: int | None = None
    backing_file: tuple[int, int] | None = None     # (st_dev, st_ino) of the backing
    passthrough_opens: int = 0
    cached_opens: int = 0
    write_opens: int = 0


@dataclass
class _Handle:
    ino: int
    writable: bool
    passthrough: bool


class OpenTable:
    """Open file handles per inode: which io mode each open got, shared backing ids (one
    per inode, closed at the inode's last RELEASE), and whether an inode may be open for
    writing (its attributes must then not be cached)."""

    def __init__(self, devfd: int, passthrough: bool, conflict_wait: float = 2.0):
        self._devfd = devfd
        self.passthrough = passthrough
        self.conflict_wait = conflict_wait
        self._lock = threading.Condition()
        self._inodes: dict[int, _InodeIO] = {}
        self._handles: dict[int, _Handle] = {}
        self._warned: set[int] = set()

    def open(self, ino: int, fh: int, writable: bool,
             passthrough_fd: Callable[[], int | None],
             own_fd: Callable[[], int | None] = lambda: None) -> tuple[int, int]:
        """Record an open; returns (fuse open_flags, backing_id) for the OPEN reply.
        ``own_fd``: the file the handle reads and writes when it is not to be passed through
        (a write open near the cache limit).  The kernel passes every open of an inode that
        has a backing file through to it, so such an open of another file (a new generation
        while a reader holds the old one) waits for that backing to close, then EBUSY:
        never are its writes sent into the old generation's file."""
        fd = passthrough_fd() if self.passthrough else None
        mine = fd if fd is not None or not self.passthrough else own_fd()
        ident = None
        if mine is not None:
            st = os.fstat(mine)
            ident = (st.st_dev, st.st_ino)
        with self._lock:
            io = self._inodes.setdefault(ino, _InodeIO())
            if ident is not None and io.backing_file not in (None, ident):
                io = self._wait_for_backing_close(ino)
            use_pt = False
            if io.backing_id is not None:
                use_pt = True           # the kernel insists on the inode's backing
            elif fd is not None and io.cached_opens == 0:
                try:
                    io.backing_id = backing_open(self._devfd, fd)
                    io.backing_file = ident
                    use_pt = True
                except OSError as e:
                    err = e.errno or 0
                    if err not in self._warned:
                        self._warned.add(err)
                        log.warning("FUSE passthrough refused for ino %d (%s); serving such "
                                    "opens through the daemon", ino, os.strerror(err))
            if use_pt:
                io.passthrough_opens += 1
            else:
                io.cached_opens += 1
            io.write_opens += writable
            self._handles[fh] = _Handle(ino, writable, use_pt)
            if use_pt and io.backing_id is not None:
                return proto.FOPEN_PASSTHROUGH, io.backing_id
            return 0, 0

    def held_by_readers(self, ino: int) -> bool:
        """Is the inode passed through to a file that only readers hold?  A write open
        may then keep to that file (in place), not move to a new generation's."""
        with self._lock:
            io = self._inodes.get(ino)
            return io is not None and io.backing_id is not None and not io.write_opens

    def wait_readers(self, ino: int) -> None:
        """Wait for the readers' backing file of ``ino`` to close (then EBUSY)."""
        with self._lock:
            self._wait_for_backing_close(ino)

    def _wait_for_backing_close(self, ino: int) -> _InodeIO:
        """The inode is passed through to another cache file than this open's (called with
        the lock held).  Give in-flight RELEASEs a moment; then refuse with EBUSY."""
        ok = self._lock.wait_for(lambda: ino not in self._inodes
                                 or self._inodes[ino].backing_id is None, self.conflict_wait)
        if not ok:
            log.warning("open of ino %d refused (EBUSY): it is still open through an older "
                        "cache file, and the kernel allows one backing file per inode", ino)
            raise FsError(errno.EBUSY)
        return self._inodes.setdefault(ino, _InodeIO())

    def release(self, fh: int) -> None:
        """Forget an open; closes the inode's backing id with its last passthrough open."""
        with self._lock:
            h = self._handles.pop(fh, None)
            if h is None:
                return
            io = self._inodes[h.ino]
            io.write_opens -= h.writable
            if h.passthrough:
                io.passthrough_opens -= 1
                if io.passthrough_opens == 0 and io.backing_id is not None:
                    self._close(io.backing_id)
                    io.backing_id = io.backing_file = None
            else:
                io.cached_opens -= 1
            if not (io.passthrough_opens or io.cached_opens):
                del self._inodes[h.ino]
            self._lock.notify_all()

    def is_passthrough(self, fh: int) -> bool:
        h = self._handles.get(fh)
        return bool(h and h.passthrough)

    def may_be_writing(self, ino: int) -> bool:
        io = self._inodes.get(ino)
        return bool(io and io.write_opens)

    def open_handles(self) -> list[int]:
        with self._lock:
            return list(self._handles)

    def close_all(self) -> None:
        with self._lock:
            for io in self._inodes.values():
                if io.backing_id is not None:
                    self._close(io.backing_id)
                    io.backing_id = None
            self._inodes.clear()
            self._handles.clear()

    def _close(self, backing_id: int) -> None:
        try:
            backing_close(self._devfd, backing_id)
        except OSError as e:
            if e.errno != errno.ENODEV:      # connection already gone: ids died with it
                log.warning("FUSE_DEV_IOC_BACKING_CLOSE(%d): %s", backing_id, e)


# --- capability probe ----------------------------------------------------------------------

def _fs_magic(path: str) -> int:
    buf = ctypes.create_string_buffer(128)           # struct statfs; f_type comes first
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return struct.unpack_from("<q", buf.raw)[0] & 0xFFFFFFFF


def required_stack_depth(cache_dir: str) -> int:
    """max_stack_depth to negotiate for backing files in ``cache_dir``: 2 when it sits on
    a stacked file system (overlayfs, ecryptfs, another FUSE mount), else 1."""
    return 2 if _fs_magic(cache_dir) in STACKED_FS_MAGIC else 1


def _kernel_version() -> tuple[int, int]:
    rel = os.uname().release
    parts = rel.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def can_mount_natively() -> tuple[bool, str]:
    """Can this process mount FUSE itself (mount(2) on /dev/fuse, no fusermount3)?"""
    if not _has_cap_sys_admin():
        return False, "mounting FUSE without fusermount3 needs CAP_SYS_ADMIN"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return False, "/dev/fuse is not accessible"
    return True, ""


def _has_cap_sys_admin() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def probe_passthrough(cache_dir: str) -> tuple[bool, str]:
    """Can this kernel, with our privileges, pass FUSE I/O through to files in
    ``cache_dir``?  Cheap checks first; then a throw-away mount that negotiates
    passthrough and registers a temporary file of ``cache_dir``.  The string is one log
    line saying why (not)."""
    kv = _kernel_version()
    if kv < (6, 9):
        return False, f"kernel {os.uname().release} has no FUSE passthrough (needs >= 6.9)"
    if not _has_cap_sys_admin():
        return False, "FUSE passthrough needs CAP_SYS_ADMIN (FUSE_DEV_IOC_BACKING_OPEN)"
    try:
        depth = required_stack_depth(cache_dir)
    except OSError as e:
        return False, f"cache dir {cache_dir}: {e.strerror}"
    try:
        devfd = _mount.open_device()
    except OSError as e:
        return False, f"/dev/fuse: {e.strerror}"
    mnt = tempfile.mkdtemp(prefix="acache-probe-")
    mounted = False
    try:
        try:
            _mount.mount_fuse(devfd, mnt, fsname="acache-probe")
            mounted = True
        except OSError as e:
            return False, f"cannot mount FUSE: {e.strerror}"
        req = os.read(devfd, 1 << 16)
        length, opcode, unique = proto.IN_HEADER.unpack_from(req)[:3]
        if opcode != proto.INIT:
            return False, f"unexpected first FUSE request (opcode {opcode})"
        payload, res = proto.negotiate_init(memoryview(req)[proto.IN_HEADER.size:length],
                                            passthrough=True, max_stack_depth=depth)
        os.write(devfd, proto.out_header(unique, 0, len(payload)) + payload)
        if res is None or not res.kernel_flags & proto.PASSTHROUGH:
            return False, "kernel does not offer FUSE_PASSTHROUGH (CONFIG_FUSE_PASSTHROUGH off?)"
        if res.kernel_minor < proto.PASSTHROUGH_MINOR:
            return False, f"kernel FUSE protocol 7.{res.kernel_minor} < 7.40"
        with tempfile.TemporaryFile(dir=cache_dir) as f:
            try:
                backing_close(devfd, backing_open(devfd, f.fileno()))
            except OSError as e:
                why = {errno.EPERM: "not permitted (CAP_SYS_ADMIN?)",
                       errno.ELOOP: f"cache dir is stacked too deep (max_stack_depth={depth})",
                       errno.EINVAL: "the cache dir's file system cannot back passthrough"}
                return False, f"FUSE passthrough refused: {why.get(e.errno or 0) or e.strerror}"
        return True, (f"FUSE passthrough available (kernel {os.uname().release}, protocol "
                      f"7.{res.kernel_minor}, max_stack_depth={depth})")
    finally:
        if mounted:
            _mount.umount(mnt, lazy=True)
        os.close(devfd)
        try:
            os.rmdir(mnt)
        except OSError:
            pass
