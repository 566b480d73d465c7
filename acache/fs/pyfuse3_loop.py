"""pyfuse3's request loop, made unable to block its trio thread on /dev/fuse.

pyfuse3 waits until the session fd polls readable, then read()s it -- a blocking read,
in the one thread that runs the trio loop.  The kernel can take back what made the fd
readable in between: a queued INTERRUPT is dropped when its request is answered (with
io_uring I/O in flight, completions interrupt the submitter's other requests all the
time), a queued request is dropped when its caller is killed.  The read then sleeps in
the kernel with the trio loop inside it -- and with the GIL held (pyfuse3 does not
release it around the read), so the whole daemon stops: no answer a worker thread has
computed (getattr, getxattr, read-through) is sent, nothing persists, the control socket
is dead, until some new request arrives.  Requests hung until an unrelated operation
touched the mount.

Two changes, both made once per process before the loop starts:

- pyfuse3 sees a ``trio`` whose ``lowlevel.wait_readable`` checks, after trio reports the
  fd readable, that it still is (poll with no timeout) and otherwise waits again (the
  hook pyfuse3.asyncio uses to swap the event loop);
- the session fd is non-blocking, so a read that finds nothing after all returns EAGAIN
  (BlockingIOError from pyfuse3's loop) instead of sleeping; the loop task then simply
  goes on.  pyfuse3 frees its request buffer only when its loop ends normally: each
  such EAGAIN leaves one buffer (~1 MiB) behind, and the check above leaves it only the
  microseconds between poll and read to happen in.
"""
from __future__ import annotations

import logging
import os
import select

import pyfuse3
import trio

log = logging.getLogger("acache.fs.pyfuse3")


def readable_now(fd: int) -> bool:
    """Does ``fd`` poll readable (or in error: let the reader find out) right now?"""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


class _Lowlevel:
    def __getattr__(self, name: str):
        return getattr(trio.lowlevel, name)

    @staticmethod
    async def wait_readable(fd) -> None:
        while True:
            await trio.lowlevel.wait_readable(fd)
            if readable_now(fd):
                return


class _Trio:
    """trio as pyfuse3 sees it: the same, but for ``lowlevel.wait_readable``."""

    lowlevel = _Lowlevel()

    def __getattr__(self, name: str):
        return getattr(trio, name)


def _patch_loop() -> None:
    if getattr(pyfuse3, "_acache_loop", None) is not None:
        return
    loop = pyfuse3._session_loop    # type: ignore[attr-defined]  # looked up by name each time pyfuse3 starts a loop task

    async def session_loop(*args) -> None:
        while True:
            try:
                return await loop(*args)
            except BlockingIOError:   # the request was taken back after the check
                log.debug("the FUSE request went away before it was read; waiting again")

    pyfuse3._session_loop = session_loop     # type: ignore[attr-defined]
    pyfuse3._acache_loop = session_loop      # type: ignore[attr-defined]
    pyfuse3.trio = _Trio()                   # type: ignore[attr-defined]


def fuse_fds() -> set[int]:
    """This process's descriptors of /dev/fuse."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                out.add(int(name))
        except OSError:
            continue
    return out


def init(ops, mountpoint: str, options) -> None:
    """pyfuse3.init, then its session fd made non-blocking and its loop patched."""
    before = fuse_fds()
    pyfuse3.init(ops, mountpoint, options)
    new = fuse_fds() - before
    _patch_loop()
    if len(new) == 1:
        os.set_blocking(new.pop(), False)
    else:   # (another /dev/fuse opened meanwhile) the readiness re-check still holds
        log.warning("cannot tell pyfuse3's /dev/fuse descriptor among %s: left blocking", sorted(new))
