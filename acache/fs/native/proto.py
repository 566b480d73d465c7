"""The FUSE wire protocol, as far as acache speaks it.

Constants and layouts follow the kernel's ``include/uapi/linux/fuse.h`` (protocol 7.40+,
which adds passthrough).  Debian's installed header is 7.38 and lacks the passthrough
fields, so everything is written down here.  All integers are little-endian (we only run
on little-endian Linux hosts; the kernel uses host byte order).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from acache.fs.types import Attr, StatFs

KERNEL_VERSION = 7
OUR_MINOR = 40            # max_stack_depth, backing_id, FOPEN_PASSTHROUGH
PASSTHROUGH_MINOR = 40
ROOT_ID = 1

# --- opcodes -------------------------------------------------------------------------------
LOOKUP, FORGET, GETATTR, SETATTR, READLINK, SYMLINK = 1, 2, 3, 4, 5, 6
MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, OPEN, READ, WRITE = 8, 9, 10, 11, 12, 13, 14, 15, 16
STATFS, RELEASE, FSYNC, SETXATTR, GETXATTR, LISTXATTR, REMOVEXATTR = 17, 18, 20, 21, 22, 23, 24
FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR, FSYNCDIR = 25, 26, 27, 28, 29, 30
GETLK, SETLK, SETLKW, ACCESS, CREATE, INTERRUPT, BMAP, DESTROY = 31, 32, 33, 34, 35, 36, 37, 38
IOCTL, POLL, NOTIFY_REPLY, BATCH_FORGET, FALLOCATE, READDIRPLUS = 39, 40, 41, 42, 43, 44
RENAME2, LSEEK, COPY_FILE_RANGE, SETUPMAPPING, REMOVEMAPPING = 45, 46, 47, 48, 49
SYNCFS, TMPFILE, STATX = 50, 51, 52

OPCODE_NAMES = {v: k for k, v in list(globals().items())
                if k.isupper() and isinstance(v, int) and 1 <= v <= 52 and k not in
                ("KERNEL_VERSION", "ROOT_ID")}

# --- INIT flags (flags | flags2 << 32) -----------------------------------------------------
ASYNC_READ = 1 << 0
ATOMIC_O_TRUNC = 1 << 3
BIG_WRITES = 1 << 5
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
WRITEBACK_CACHE = 1 << 16
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
HANDLE_KILLPRIV_V2 = 1 << 28   # sets SB_NOSEC: no GETXATTR(security.capability) per write
INIT_EXT = 1 << 30
PASSTHROUGH = 1 << 37     # flags2 bit 5

# --- misc flags ----------------------------------------------------------------------------
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_CACHE_DIR = 1 << 3     # the kernel keeps a directory's listing (dirs only)
FOPEN_NOFLUSH = 1 << 5       # no FLUSH at close(2) (ignored under WRITEBACK_CACHE; 7.35+)
FOPEN_PASSTHROUGH = 1 << 7   # never with KEEP_CACHE: the kernel fails the open (EIO)
GETATTR_FH = 1 << 0
FSYNC_FDATASYNC = 1 << 0
FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FATTR_ATIME, FATTR_MTIME, FATTR_FH = 1 << 4, 1 << 5, 1 << 6
FATTR_ATIME_NOW, FATTR_MTIME_NOW = 1 << 7, 1 << 8
FATTR_LOCKOWNER, FATTR_CTIME = 1 << 9, 1 << 10
FATTR_KILL_SUIDGID = 1 << 11
WRITE_KILL_SUIDGID = 1 << 2
OPEN_KILL_SUIDGID = 1 << 0
FILESYSTEM_MAX_STACK_DEPTH = 2

# --- /dev/fuse ioctls: _IOW(229, nr, size) -------------------------------------------------
def _iow(nr: int, size: int) -> int:
    return (1 << 30) | (size << 16) | (229 << 8) | nr


BACKING_MAP = struct.Struct("<iIQ")                 # fuse_backing_map {fd, flags, padding}
DEV_IOC_BACKING_OPEN = _iow(1, BACKING_MAP.size)    # 0x4010e501
DEV_IOC_BACKING_CLOSE = _iow(2, 4)                  # 0x4004e502

# --- layouts -------------------------------------------------------------------------------
IN_HEADER = struct.Struct("<IIQQIIIHH")   # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")        # len error unique
NOTIFY_INVAL_INODE = 2                     # a notification: OUT_HEADER with unique 0, this as error
NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")   # ino off len (off 0, len 0: all its pages)
ATTR = struct.Struct("<QQQqqqIIIIIIIIII")  # fuse_attr, 88 bytes
ENTRY_OUT_HEAD = struct.Struct("<QQQQII")  # nodeid generation entry_valid attr_valid nsec nsec
ATTR_OUT_HEAD = struct.Struct("<QII")      # attr_valid attr_valid_nsec dummy
DIRENT = struct.Struct("<QQII")            # ino off namelen type
INIT_IN = struct.Struct("<IIIII")          # major minor max_readahead flags flags2
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")
OPEN_OUT = struct.Struct("<QIi")           # fh open_flags backing_id
KSTATFS = struct.Struct("<QQQQQIII4x24x")  # fuse_kstatfs, 80 bytes
GETATTR_IN = struct.Struct("<IIQ")
SETATTR_IN = struct.Struct("<IIQQQqqqIIIIIIII")
MKNOD_IN = struct.Struct("<IIII")
MKDIR_IN = struct.Struct("<II")
CREATE_IN = struct.Struct("<IIII")
OPEN_IN = struct.Struct("<II")
READ_IN = struct.Struct("<QQIIQII")        # fh offset size read_flags lock_owner flags pad
WRITE_IN = READ_IN
WRITE_OUT = struct.Struct("<II")
RELEASE_IN = struct.Struct("<QIIQ")
FLUSH_IN = struct.Struct("<QIIQ")
FSYNC_IN = struct.Struct("<QII")
FORGET_IN = struct.Struct("<Q")
BATCH_FORGET_IN = struct.Struct("<II")
FORGET_ONE = struct.Struct("<QQ")
RENAME_IN = struct.Struct("<Q")
RENAME2_IN = struct.Struct("<QII")
GETXATTR_IN = struct.Struct("<II")
GETXATTR_OUT = struct.Struct("<II")
SETXATTR_IN = struct.Struct("<II")         # compat size: we do not negotiate SETXATTR_EXT
INTERRUPT_IN = struct.Struct("<Q")
FALLOCATE_IN = struct.Struct("<QQQII")

DIRENT_ALIGN = 8


def split_names(data: bytes | memoryview, count: int) -> list[bytes]:
    """The NUL-terminated names that follow a request's fixed part."""
    parts = bytes(data).split(b"\0")
    return parts[:count]


def _split_ns(ns: int) -> tuple[int, int]:
    return divmod(ns, 1_000_000_000)


def pack_attr(a: Attr) -> bytes:
    at, atn = _split_ns(a.atime_ns)
    mt, mtn = _split_ns(a.mtime_ns)
    ct, ctn = _split_ns(a.ctime_ns)
    return ATTR.pack(a.ino, a.size, a.blocks, at, mt, ct, atn, mtn, ctn, a.mode, a.nlink,
                     a.uid, a.gid, a.rdev, a.blksize, 0)


def _split_timeout(t: float) -> tuple[int, int]:
    sec = int(t)
    return sec, int((t - sec) * 1e9)


def pack_entry(a: Attr | None, entry_valid: float, attr_valid: float) -> bytes:
    """fuse_entry_out; ``a=None`` gives nodeid 0 (no entry handed to the kernel)."""
    es, ens = _split_timeout(entry_valid)
    as_, ans = _split_timeout(attr_valid)
    if a is None:
        return ENTRY_OUT_HEAD.pack(0, 0, es, as_, ens, ans) + bytes(ATTR.size)
    return ENTRY_OUT_HEAD.pack(a.ino, a.generation, es, as_, ens, ans) + pack_attr(a)


def pack_attr_out(a: Attr, attr_valid: float) -> bytes:
    s, ns = _split_timeout(attr_valid)
    return ATTR_OUT_HEAD.pack(s, ns, 0) + pack_attr(a)


def pack_dirent(ino: int, next_off: int, name: bytes, mode: int) -> bytes:
    rec = DIRENT.pack(ino, next_off, len(name), (mode & 0o170000) >> 12) + name
    return rec + bytes(-len(rec) % DIRENT_ALIGN)


def pack_statfs(s: StatFs) -> bytes:
    return KSTATFS.pack(s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namemax,
                        s.frsize)


def out_header(unique: int, error: int, payload_len: int) -> bytes:
    return OUT_HEADER.pack(OUT_HEADER.size + payload_len, error, unique)


@dataclass
class InitResult:
    """What INIT negotiated."""
    kernel_minor: int
    minor: int
    flags: int               # the flags we replied with (flags | flags2 << 32)
    kernel_flags: int
    passthrough: bool        # asked for and offered (the kernel may still refuse: probe it)
    max_write: int
    max_pages: int
    max_stack_depth: int


def negotiate_init(payload: bytes | memoryview, *, passthrough: bool, max_stack_depth: int,
                   writeback_cache: bool = False, max_pages: int = 256,
                   readdirplus: bool = True) -> tuple[bytes, InitResult | None]:
    """Build the INIT reply for the kernel's INIT request.

    Returns (reply payload, result); result is None when the kernel speaks a newer major
    version and we answered only with ours (the kernel then sends a second INIT).
    """
    major, kminor, max_readahead, kflags, kflags2 = INIT_IN.unpack_from(
        bytes(payload).ljust(INIT_IN.size, b"\0"))
    if major > KERNEL_VERSION:
        return struct.pack("<II", KERNEL_VERSION, OUR_MINOR), None
    if major < KERNEL_VERSION:
        raise OSError(f"kernel FUSE protocol {major}.{kminor} is too old")
    if kflags & INIT_EXT:
        kflags |= kflags2 << 32
    minor = min(kminor, OUR_MINOR)
    # HANDLE_KILLPRIV_V2: without it the kernel asks for security.capability before
    # every write (file_remove_privs), one round trip per write even under passthrough.
    want = (ASYNC_READ | ATOMIC_O_TRUNC | BIG_WRITES | AUTO_INVAL_DATA | PARALLEL_DIROPS
            | MAX_PAGES | HANDLE_KILLPRIV_V2 | INIT_EXT)
    if readdirplus:
        want |= DO_READDIRPLUS | READDIRPLUS_AUTO
    if writeback_cache:
        want |= WRITEBACK_CACHE
    pt = bool(passthrough and minor >= PASSTHROUGH_MINOR and kflags & PASSTHROUGH)
    if pt:
        want |= PASSTHROUGH
    flags = want & (kflags | INIT_EXT)
    if not kflags & MAX_PAGES:
        max_pages = 32
    max_write = max_pages * 4096
    depth = max(1, min(max_stack_depth, FILESYSTEM_MAX_STACK_DEPTH)) if pt else 0
    reply = INIT_OUT.pack(KERNEL_VERSION, minor, max_readahead, flags & 0xFFFFFFFF,
                          64, 48,             # max_background, congestion_threshold
                          max_write, 1,       # time_gran: 1 ns
                          max_pages, 0, flags >> 32, depth)
    return reply, InitResult(kminor, minor, flags, kflags, pt, max_write, max_pages, depth)
