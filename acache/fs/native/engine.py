"""NativeEngine: mount a VFS through /dev/fuse ourselves, with kernel passthrough."""
from __future__ import annotations

import logging
import os
import threading

from acache.fs.native import mount as _mount
from acache.fs.native import proto
from acache.fs.native.ops import Ops
from acache.fs.native.passthrough import OpenTable, connection_has_passthrough
from acache.fs.native.session import Session

log = logging.getLogger("acache.fs.native")


class NativeEngine:
    """Serve ``vfs`` at ``mountpoint``.

    ``start()`` mounts and returns once the kernel's INIT is answered; ``stop()`` detaches
    the mount and ends the session (idempotent); ``wait()`` blocks until the session ends.
    ``passthrough_active`` says what INIT really negotiated (the kernel may refuse).
    """

    def __init__(self, vfs, mountpoint: str, *, passthrough: bool, max_stack_depth: int = 1,
                 threads: int = 8, fsname: str = "acache", entry_timeout: float = 1.0,
                 attr_timeout: float = 1.0, conflict_wait: float = 2.0,
                 writeback_cache: bool = False):
        # writeback_cache exists to demonstrate (in tests) that the kernel then refuses
        # passthrough; the node daemon never sets it.
        self.vfs = vfs
        self.mountpoint = os.path.abspath(mountpoint)
        self.passthrough = passthrough
        self.max_stack_depth = max_stack_depth
        self.threads = threads
        self.fsname = fsname
        self.entry_timeout = entry_timeout
        self.attr_timeout = attr_timeout
        self.writeback_cache = writeback_cache
        self.conflict_wait = conflict_wait      # see passthrough.OpenTable
        self.passthrough_active = False
        self.init = None                    # proto.InitResult once started
        self._devfd: int | None = None
        self._session: Session | None = None
        self._ops: Ops | None = None
        self._conn: tuple[int, int] | None = None
        self._mounted = False
        self._lock = threading.Lock()
        self._finished = threading.Event()

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._devfd is not None:
            raise RuntimeError("NativeEngine.start() called twice")
        if not os.path.isdir(self.mountpoint):
            _mount.clean_stale_mount(self.mountpoint)
            if not os.path.isdir(self.mountpoint):
                raise FileNotFoundError(f"mount point {self.mountpoint} is not a directory")
        # Canonical path now, while it is a plain directory: once mounted, any stat of it
        # blocks until INIT is answered.
        self.mountpoint = os.path.realpath(self.mountpoint)
        self._devfd = devfd = _mount.open_device()
        try:
            _mount.mount_fuse(devfd, self.mountpoint, fsname=self.fsname)
            self._mounted = True
            session = Session(devfd, {}, threads=self.threads, bufsize=(1 << 20) + 4096)
            session.on_failure = self.vfs.after_failure
            self.init = res = session.handshake(self._negotiate)
            self._conn = _mount.mount_dev(self.mountpoint)
            self.passthrough_active = res.passthrough and connection_has_passthrough(devfd)
            if self.passthrough and not self.passthrough_active:
                log.warning("FUSE passthrough requested but not in effect on %s (%s); the "
                            "daemon serves reads and writes", self.mountpoint,
                            "kernel refused it" if res.passthrough else "kernel lacks it")
            session.bufsize = res.max_write + 4096
            table = OpenTable(devfd, self.passthrough_active, self.conflict_wait)
            self._ops = Ops(self.vfs, table, entry_timeout=self.entry_timeout,
                            attr_timeout=self.attr_timeout)
            session.handlers = self._ops.handlers
            session.overlap = self._ops.overlap
            session.flush_read = self._ops.flush_read if self._ops.shared else None
            self._ops.drop_pages = session.drop_pages
            self._ops.inval_attr = session.inval_attr
            self._session = session
            session.start(name=f"acache-fuse{self._conn[1] if self._conn else ''}")
        except BaseException:
            if self._mounted:
                _mount.umount(self.mountpoint, lazy=True)
                self._mounted = False
            os.close(devfd)
            self._devfd = None
            raise
        threading.Thread(target=self._reap, name="acache-fuse-reaper", daemon=True).start()
        log.info("mounted %s (native engine, FUSE 7.%d, passthrough %s, %d threads)",
                 self.mountpoint, res.minor, "on" if self.passthrough_active else "off",
                 self.threads)

    def _negotiate(self, payload):
        return proto.negotiate_init(payload, passthrough=self.passthrough,
                                    max_stack_depth=self.max_stack_depth,
                                    writeback_cache=self.writeback_cache)

    def stop(self, timeout: float = 5.0) -> None:
        """Detach the mount and end the session.  A mount kept busy by open files is
        aborted after ``timeout`` (its users then get ENOTCONN)."""
        with self._lock:
            session = self._session
            if session is None or self._finished.is_set():
                self._finished.wait(timeout)
                return
            if self._mounted:
                try:
                    _mount.umount(self.mountpoint, lazy=True)
                except OSError as e:
                    log.warning("unmounting %s: %s", self.mountpoint, e)
                self._mounted = False
        if not session.ended.wait(timeout) and self._conn is not None:
            log.warning("%s still busy after detach; aborting its FUSE connection",
                        self.mountpoint)
            _mount.abort_connection(self._conn[1])
            session.ended.wait(timeout)
        self._finished.wait(timeout)

    def wait(self) -> None:
        """Block until the session ends (unmounted from outside, or stop())."""
        if self._session is None:
            return
        self._finished.wait()

    def _reap(self) -> None:
        session, ops = self._session, self._ops
        assert session is not None and ops is not None
        session.ended.wait()
        session.join(timeout=5.0)
        with self._lock:
            self._mounted = False
            try:
                ops.release_all()
                ops.table.close_all()
            except Exception:
                log.exception("cleaning up after the FUSE session")
            if self._devfd is not None:
                os.close(self._devfd)
                self._devfd = None
        self._finished.set()
        log.info("FUSE session on %s ended", self.mountpoint)

    # --- introspection ---------------------------------------------------------------------

    def op_stats(self):
        """The session's OpStats (FUSE requests by kind, with latencies), or None."""
        return self._session.stats if self._session else None

    def op_counts(self) -> dict[str, int]:
        """FUSE requests received so far, by opcode name."""
        return self._session.op_counts() if self._session else {}

    @property
    def devfd(self) -> int | None:
        return self._devfd
