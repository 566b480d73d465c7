"""The kernel's read-ahead for a FUSE mount (its backing_dev_info, in sysfs).

A FUSE mount starts with the kernel's default of 128 KiB, and the INIT reply can only
lower it.  With that, a sequential reader has one or two 1 MiB READs at the daemon at a
time, so each round trip through the daemon (a thread wake-up on a busy host) stalls the
reader.  A larger window keeps several READs in flight, which the engines' threads serve
in parallel.  Root only (sysfs); elsewhere the mount keeps the default.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("acache.fs")
READ_AHEAD_KIB = 8192     # eight 1 MiB READs in flight (the native engine's thread count)


def set_read_ahead(mountpoint: str, kib: int = READ_AHEAD_KIB) -> bool:
    try:
        dev = os.stat(mountpoint).st_dev
        with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb", "w") as f:
            f.write(str(kib))
        return True
    except OSError as e:
        log.debug("read-ahead of %s stays the kernel's: %s", mountpoint, e)
        return False
