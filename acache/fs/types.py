"""Plain values shared by the VFS and the mount engines."""
from __future__ import annotations

from dataclasses import dataclass

ROOT_INO = 1
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
UTIME_NOW = -1          # setattr(atime_ns=UTIME_NOW) means "now"
STATE_XATTR = b"user.acache.state"


@dataclass
class Attr:
    ino: int
    mode: int           # full st_mode (type bits included)
    nlink: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    blocks: int = 0     # 512-byte units
    rdev: int = 0
    blksize: int = 1 << 20
    generation: int = 0


@dataclass(frozen=True)
class Ctx:
    """Who is asking: from the FUSE request header."""
    uid: int = 0
    gid: int = 0
    pid: int = 0
    umask: int = 0o022


@dataclass
class StatFs:
    bsize: int
    frsize: int
    blocks: int
    bfree: int
    bavail: int
    files: int
    ffree: int
    namemax: int = 255
