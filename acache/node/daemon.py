"""The node daemon: wires meta, cache, persister, VFS and the mount together.

`acache up` runs one of these per host (in the background); the CLI talks to
it over a unix socket (acache.node.server); only this process opens RocksDB.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from acache.config import Settings, check_layout
from acache.data import limit
from acache.data.cache import CacheDir
from acache.data.persister import Persister
from acache.data.under import open_store
from acache.errors import AcacheError, ConfigError, UnderStoreError
from acache.fs.native.mount import clean_stale_mount
from acache.fs.vfs import VFS
from acache.meta.reserve import Reserve
from acache.meta.store import MetaStore
from acache.node.backend import Backend, Clustered, Single, Steps

if TYPE_CHECKING:
    from acache.cluster.client import ClientVFS
    from acache.cluster.member import Member
    from acache.node.metrics import MetricsServer

log = logging.getLogger("acache.node")
# How long the kernel may keep a name -> inode answer. The namespace changes only through
# the one mount (create, rename, unlink... update the kernel's names as they happen; an
# under-storage directory's entries are merged before anything of it is looked up or
# listed), so a name cannot go stale: a long timeout spares a LOOKUP per path operation
# on a file not touched for a second.  A missing name is kept as long (a negative entry,
# native engine): it can appear only through the mount too.
NATIVE_ENTRY_TIMEOUT = 60.0


def _check_writable(path: Path, what: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".acache-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{what} {path} is not usable: {e.strerror}") from None


class _Engine(Protocol):
    """What the node asks of a mount engine (NativeEngine, Pyfuse3Engine)."""
    passthrough_active: bool

    def start(self) -> None: ...

    def wait(self) -> None: ...

    def stop(self) -> None: ...


class Node:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.started = time.time()
        _check_writable(settings.home, "state directory")
        _check_writable(settings.cache_path, "cache directory")
        self.under = open_store(settings.ufs_url, dict(settings.s3))
        # every upload of the node goes through this one bucket (rate None: no limit)
        self.limiter = limit.TokenBucket(limit.parse(settings.upload_limit))
        self.under.set_limiter(self.limiter.take)
        try:
            self.under.check()
        except UnderStoreError as e:
            if e.retryable:   # an outage: start anyway, so the job can write; the persister retries
                log.warning("under-storage %s is unreachable for now (writes are cached and "
                            "persisted when it is back): %s", settings.ufs_url, e)
            else:             # bad credentials, missing bucket: refuse to start
                msg = str(e) if "under-storage" in str(e) else \
                    f"under-storage {settings.ufs_url} is not usable: {e}"
                raise ConfigError(msg) from None
        # the RocksDB stays where it always was (<cache>/meta: existing nodes keep theirs),
        # with a reserve of room on that filesystem for it (acache.meta.reserve)
        self.reserve = Reserve(str(settings.cache_path / "meta.reserve"), settings.meta_reserve)
        self.cache = CacheDir(str(settings.cache_path), settings.resolved_cache_size(),
                              settings.stall_timeout, reserve=self.reserve)
        # where the namespace lives: this node's RocksDB, or a cluster's head (etcd)
        self.backend: Backend = Clustered.open(settings, self.cache, self.under) \
            if settings.meta else Single.open(settings, self.cache, self.under, self.reserve)
        self.vfs: VFS | ClientVFS = self.backend.vfs
        # for the metrics and tests: the cluster's Member, or one host's store and persister
        self.member: Member | None = getattr(self.backend, "member", None)
        self.meta: MetaStore | None = getattr(self.backend, "meta", None)
        self.persister: Persister | None = getattr(self.backend, "persister", None)
        self.cache.start_monitor()
        if self.cache.effective_limit() < self.cache.limit:
            log.warning("the cache filesystem has room for %d MiB of cache only (its free space "
                        "less the %d MiB metadata reserve), not the %d MiB of cache_size",
                        self.cache.effective_limit() >> 20, settings.meta_reserve >> 20,
                        self.cache.limit >> 20)
        self.engine: _Engine | None = None
        self.engine_name = ""
        self.engine_why = ""
        self.mountpoint: str | None = None
        self.stopping = threading.Event()
        self.metrics: MetricsServer | None = None   # acache.node.metrics.MetricsServer, started by serve_metrics()
        log.info("node up: cache %s (limit %d bytes), under-storage %s, %s",
                 settings.cache_path, self.cache.limit, settings.ufs_url,
                 self.backend.describe())

    def serve_metrics(self) -> None:
        """Start the /metrics endpoint if ``metrics`` is set (ConfigError if it cannot listen)."""
        if self.settings.metrics:
            from acache.node.metrics import MetricsServer
            self.metrics = MetricsServer(self, self.settings.metrics, self.settings.source("metrics"))

    # -- the mount ----------------------------------------------------------------------
    def _choose_engine(self, want: str):
        want = want or self.settings.engine
        if want in ("auto", "native"):
            try:
                from acache.fs.native import (NativeEngine, can_mount_natively, probe_passthrough,
                                              required_stack_depth)
            except ImportError as e:
                if want == "native":
                    raise ConfigError(f"the native engine is not available: {e}") from None
                return "pyfuse3", f"native engine unavailable ({e})", None
            if self.settings.passthrough:
                ok, why = probe_passthrough(str(self.cache.dir))
            else:
                ok, why = False, "passthrough = false in the settings"
            # Without passthrough the native engine still beats pyfuse3 on every case of
            # scripts/bench (it negotiates HANDLE_KILLPRIV_V2, so no getxattr per write, and
            # serves from a thread pool): pyfuse3 is for when we cannot mount ourselves.
            native, why_not = can_mount_natively()
            if ok or want == "native" or native:
                # the stacking depth matters only for passthrough (the probe computed it)
                depth = required_stack_depth(str(self.cache.dir)) if ok else 1
                if not ok:
                    why = f"no passthrough ({why}); the native engine serves the data itself"
                return "native", why, lambda mp: NativeEngine(self.vfs, mp, passthrough=ok,
                                                              max_stack_depth=depth,
                                                              entry_timeout=1.0 if
                                                              self.backend.shared
                                                              else NATIVE_ENTRY_TIMEOUT)
            return "pyfuse3", f"no passthrough ({why}) and {why_not}", None
        if want == "pyfuse3":
            return "pyfuse3", "asked for", None
        raise ConfigError(f"unknown engine {want!r} (auto, native, pyfuse3)")

    def mount(self, path: str, engine: str = "", placement: str = "") -> dict:
        from acache.fs.readahead import set_read_ahead
        path = os.path.abspath(path)
        if placement and placement != self.settings.placement:
            raise ConfigError(
                f"the running node has placement = {self.settings.placement} "
                f"({self.settings.source('placement')}), this mount asks for {placement}"
                + (" (--no-cache)" if placement == "hash" else "")
                + ": `acache down` first, so the node starts again with the mount's setting")
        if self.engine is not None:
            raise ConfigError(f"already mounted at {self.mountpoint}; `acache umount {self.mountpoint}` first")
        clean_stale_mount(path)
        if not os.path.isdir(path):
            raise ConfigError(f"mount point {path} does not exist or is not a directory")
        if os.path.ismount(path):
            raise ConfigError(f"{path} is already a mount point")
        if os.listdir(path):
            raise ConfigError(f"mount point {path} is not empty")
        check_layout(self.settings, path)
        name, why, make = self._choose_engine(engine)
        if make is None:
            from acache.fs.pyfuse3_engine import Pyfuse3Engine
            eng = Pyfuse3Engine(self.vfs, path)
        else:
            eng = make(path)
        try:
            eng.start()
        except AcacheError:
            raise
        except Exception as e:
            if name != "native" or (engine or self.settings.engine) != "auto":
                raise ConfigError(f"mounting {path} failed: {e}") from None
            log.warning("the native engine could not mount %s (%s): using pyfuse3", path, e)
            from acache.fs.pyfuse3_engine import Pyfuse3Engine
            name, why, eng = "pyfuse3", f"the native engine failed to mount: {e}", Pyfuse3Engine(self.vfs, path)
            try:
                eng.start()
            except Exception as e2:
                raise ConfigError(f"mounting {path} failed: {e2}") from None
        self.engine, self.engine_name, self.engine_why, self.mountpoint = eng, name, why, path
        set_read_ahead(path)      # READs the daemon serves: several in flight, not one or two
        log.info("mounted %s with the %s engine (%s)%s", path, name, why,
                 ", kernel passthrough on" if eng.passthrough_active else "")
        threading.Thread(target=self._watch_mount, args=(eng,), daemon=True).start()
        return {"mountpoint": path, "engine": name, "why": why, "passthrough": eng.passthrough_active}

    def op_stats(self):
        """FUSE requests by kind with latencies (acache.fs.opstats), of the current mount."""
        eng: Any = self.engine       # only the native engine has op_stats
        return eng.op_stats() if eng is not None and hasattr(eng, "op_stats") else None

    def _watch_mount(self, eng: _Engine) -> None:
        eng.wait()
        if self.engine is eng:
            log.warning("the mount at %s went away", self.mountpoint)
            self.engine, self.mountpoint = None, None

    def umount(self, path: str | None = None) -> dict:
        if self.engine is None:
            raise ConfigError("nothing is mounted")
        if path and os.path.abspath(path) != self.mountpoint:
            raise ConfigError(f"{path} is not the acache mount (that is {self.mountpoint})")
        eng, mp = self.engine, self.mountpoint
        self.engine, self.mountpoint = None, None
        eng.stop()
        log.info("unmounted %s", mp)
        return {"unmounted": mp}

    # -- paths ----------------------------------------------------------------------------
    def rel(self, path: str | None) -> str:
        """A user path (on the mount) -> an under-storage relative path ('' = all)."""
        if not path:
            return ""
        path = os.path.abspath(path)
        if self.mountpoint and (path == self.mountpoint or path.startswith(self.mountpoint + "/")):
            # path is absolute and normalised: the rest after the mount point is the
            # relative path as is (a name may start or end with '.': '.metadata')
            return path[len(self.mountpoint) + 1:] if path != self.mountpoint else ""
        raise ConfigError(f"{path} is not on the acache mount ({self.mountpoint or 'not mounted'})")

    # -- what the backend answers (acache.node.backend) ---------------------------------------
    def flush(self, path: str | None, timeout: float | None, progress=None) -> dict:
        return self.backend.barrier(self.rel(path), timeout, progress)

    def status(self, path: str | None = None) -> dict:
        c = self.cache
        out: dict[str, Any] = {
            "pid": os.getpid(), "uptime": time.time() - self.started,
            "mountpoint": self.mountpoint, "engine": self.engine_name,
            "passthrough": bool(self.engine and self.engine.passthrough_active),
            "ufs": self.settings.ufs_url, "cache_dir": str(self.settings.cache_path),
            "cache_used": c.used(), "cache_limit": c.limit, "dirty_bytes": c.dirty_bytes(),
            "cache_limit_now": c.effective_limit(), "meta_reserve_held": self.reserve.held,
            "stalls": c.stalls, "time": time.time(), "metrics": self.settings.metrics,
            "ufs_reads": self.vfs.fetch.requests, "ufs_read_bytes": self.vfs.fetch.bytes_read,
            "upload_limit": limit.describe(self.limiter.rate()),
            "upload_limit_setting": self.limiter.schedule.text,
            "uploaded_bytes": self.limiter.taken,
            "fuse_requests": getattr(self.engine, "op_counts", dict)(),   # native: by opcode
        }
        # cache files the metadata did not know at start (listed outside the lock)
        out["lost_found_files"], out["lost_found_bytes"] = c.lost_found()
        out["lost_found_dir"] = c.lost_dir
        self.backend.status(self.rel(path) if path is not None else None, out)
        return out

    # -- the journal, for the operator --------------------------------------------------------
    def journal(self, limit: int = 100) -> dict:
        return self.backend.journal(limit)

    def journal_skip(self, seq: int, reason: str) -> dict:
        return self.backend.journal_skip(seq, reason)

    def _stop_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

    # -- stop ---------------------------------------------------------------------------------
    def shutdown(self, flush: bool = True, timeout: float | None = None) -> dict:
        """Stop.  Each step runs even if one before failed (a metadata store that fails its
        writes must not keep the node up): what was acknowledged is in the KV already and
        replays at the next start."""
        from acache.node.notify import notify
        notify("STOPPING=1")
        out: dict[str, Any] = {"flushed": False, "left_dirty": 0}
        if flush:
            self.flush(None, timeout)
            out["flushed"] = True
        out["left_dirty"] = self.backend.left_dirty()
        steps: Steps = [("unmounting", lambda: self.engine is not None and self.umount())]
        steps += self.backend.stop_steps()
        steps += [("closing the under-storage", self.under.close),
                  ("stopping the metrics endpoint", self._stop_metrics)]
        for what, step in steps:
            try:
                step()
            except Exception as e:
                log.error("%s failed while stopping: %s", what, e)
        self.stopping.set()
        return out
