"""mount(2) / umount2(2) for a /dev/fuse session, without fusermount or libfuse.

``clean_stale_mount`` is shared by both engines (the CLI calls it before mounting).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os

log = logging.getLogger("acache.fs.native")

MS_NOSUID = 2
MS_NODEV = 4
MNT_DETACH = 2
FUSECTL_DIR = "/sys/fs/fuse/connections"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _check(rc: int, what: str, path: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what} {path}: {os.strerror(err)}", path)


def open_device() -> int:
    """Open /dev/fuse (close-on-exec, so children never keep the session alive)."""
    return os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)


def mount_fuse(devfd: int, mountpoint: str, *, fsname: str = "acache",
               subtype: str = "acache", extra: str = "") -> None:
    """Mount a FUSE file system served on ``devfd`` at ``mountpoint``.

    The kernel queues the INIT request on ``devfd`` during this call; it is answered by
    the caller afterwards (every access to the mount blocks until then).
    """
    opts = (f"fd={devfd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()},"
            "allow_other,default_permissions")
    if extra:
        opts += "," + extra
    rc = _libc.mount(fsname.encode(), os.fsencode(mountpoint), f"fuse.{subtype}".encode(),
                     MS_NOSUID | MS_NODEV, opts.encode())
    _check(rc, "mount", mountpoint)


def umount(mountpoint: str, lazy: bool = True) -> bool:
    """Unmount (lazily by default). False when nothing was mounted there."""
    rc = _libc.umount2(os.fsencode(mountpoint), MNT_DETACH if lazy else 0)
    if rc != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):
            return False
        raise OSError(err, f"umount {mountpoint}: {os.strerror(err)}", mountpoint)
    return True


def clean_stale_mount(path: str) -> bool:
    """Detach a dead FUSE mount at ``path`` (its daemon is gone: stat gives ENOTCONN).

    Returns True when a stale mount was detached, False when there was nothing to do.
    """
    try:
        os.stat(path)
        return False
    except OSError as e:
        if e.errno not in (errno.ENOTCONN, errno.ECONNABORTED):
            return False
    log.warning("%s is a dead FUSE mount (its daemon is gone); detaching it", path)
    umount(path, lazy=True)
    return True


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field[i + 1:i + 4]) == 3 and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_dev(mountpoint: str) -> tuple[int, int] | None:
    """(major, minor) of the topmost mount at ``mountpoint``, read from mountinfo.

    ``mountpoint`` must already be canonical: resolving it here would stat the mount's
    root, which blocks until INIT is answered (a deadlock if called before that).
    """
    target = mountpoint
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and _unescape(fields[4]) == target:
                major, minor = fields[2].split(":")
                found = (int(major), int(minor))
    return found


def abort_connection(conn_minor: int) -> bool:
    """Abort a FUSE connection through fusectl (mounting fusectl when needed).

    Used by stop() when a lazily detached mount stays busy (open files keep it alive) and
    the reader threads would otherwise block forever.
    """
    path = os.path.join(FUSECTL_DIR, str(conn_minor), "abort")
    if not os.path.exists(path) and os.path.isdir(FUSECTL_DIR):
        rc = _libc.mount(b"fusectl", FUSECTL_DIR.encode(), b"fusectl", 0, None)
        if rc != 0:
            log.warning("cannot mount fusectl: %s", os.strerror(ctypes.get_errno()))
    try:
        with open(path, "w") as f:
            f.write("1")
        return True
    except OSError as e:
        log.warning("cannot abort FUSE connection %d: %s", conn_minor, e)
        return False
