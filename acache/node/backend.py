"""What a node's daemon runs on: one host's namespace (its own RocksDB, persister and VFS) or a
cluster's (the head's, reached through acache.cluster.member.Member).

The daemon (acache.node.daemon.Node) owns what every node has -- the under-storage, the cache
directory, the mount, the control socket -- and asks its backend for everything that depends
on where the namespace lives: the barrier, the persistence half of `status`, the journal for
the operator, how to stop.  Two classes with one shape (:class:`Backend`), so the daemon has no
cluster branches.
"""
from __future__ import annotations

import logging
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

from acache.cluster import schema
from acache.data import barrier
from acache.data.cache import CacheDir
from acache.data.persister import Persister
from acache.data.under.base import UnderStore
from acache.errors import ConfigError, FlushError, FsError, MetaError
from acache.fs.vfs import VFS
from acache.meta.kv_rocks import RocksKV
from acache.meta.reserve import Reserve
from acache.meta.store import MetaStore

if TYPE_CHECKING:
    from acache.cluster.client import ClientVFS
    from acache.cluster.member import Member
    from acache.config import Settings

log = logging.getLogger("acache.node")
Steps = list[tuple[str, Callable[[], Any]]]


class Backend(Protocol):
    @property
    def vfs(self) -> VFS | ClientVFS:
        """The mount's file system."""

    @property
    def shared(self) -> bool:
        """Do names change on other hosts too (then the kernel keeps a name 1 s only)?"""

    def describe(self) -> str:
        """For the 'node up' log line."""

    def barrier(self, rel: str, timeout: float | None, progress) -> dict:
        """`flush --wait`: until everything closed under ``rel`` before the call is persisted."""

    def status(self, rel: str | None, out: dict[str, Any]) -> None:
        """Add the persistence half of `status` to ``out`` (``rel``: the files under it)."""

    def journal(self, limit: int) -> dict: ...

    def journal_skip(self, seq: int, reason: str) -> dict: ...

    def left_dirty(self) -> int:
        """Journal entries not persisted yet (0 where this node does not keep the journal)."""

    def stop_steps(self) -> Steps:
        """What stopping takes after the unmount, in order (each runs even if one failed)."""


def _reason(reason: str) -> str:
    reason = (reason or "").strip()
    if not reason:
        raise ConfigError("say why the entry is skipped: --reason \"...\"")
    return reason


class Single:
    """One host: the namespace in this node's RocksDB, its persister, its VFS."""
    shared = False

    def __init__(self, meta: MetaStore, cache: CacheDir, persister: Persister, vfs: VFS) -> None:
        self.meta, self.cache, self.persister, self.vfs = meta, cache, persister, vfs

    @classmethod
    def open(cls, settings: Settings, cache: CacheDir, under: UnderStore,
             reserve: Reserve) -> Single:
        """Open the RocksDB, recover after a crash, start persisting."""
        meta = MetaStore(RocksKV(str(settings.cache_path / "meta"), reserve))
        persister = Persister(meta, cache, under, flush_delay=settings.flush_delay,
                              concurrency=settings.upload_concurrency)
        cache.on_stall = lambda: persister.hurry(meta.last_seq())
        vfs = VFS(meta, cache, under, persister, chunk_size=settings.chunk_size)
        rec = vfs.recover()
        if any(rec.values()):
            log.info("recovered after a crash: %s", rec)
        persister.start()
        return cls(meta, cache, persister, vfs)

    def describe(self) -> str:
        return f"{self.meta.journal_len()} journal entries pending"

    def barrier(self, rel: str, timeout: float | None, progress) -> dict:
        t0 = time.monotonic()
        try:    # files closed while a metadata write failed are not journaled yet
            self.vfs.journal_unjournaled()
        except MetaError as e:
            raise FlushError(f"cannot journal every closed file: {e}") from None
        self.meta.begin_barrier()
        try:
            return barrier.wait(self.meta, self.persister, self.cache, self.vfs._wopen, rel,
                                timeout, progress, t0)
        finally:
            self.meta.end_barrier()

    def status(self, rel: str | None, out: dict[str, Any]) -> None:
        meta, p, vfs = self.meta, self.persister, self.vfs
        with meta.lock:
            journal = meta.journal()
            out.update({
                "dirty_files": sum(1 for n in meta.inodes()
                                   if not n.is_dir and vfs.state(n) != "persisted"),
                "queue": len(journal), "queue_bytes": sum(e.size for e in journal),
                "in_flight": len(p.jobs), "rate": p.rate(), "persisted_bytes": p.bytes_done,
                "persisted_files": p.files_done, "last_error": p.last_error,
                "failed": len(p.failed), "waits_for_writer": barrier.held_for_writer(journal),
                "failed_entries": [   # permanent failures hold back what comes after them
                    {"seq": s, "op": e.op, "path": e.path, "dst": e.dst, "error": msg}
                    for s, msg in sorted(p.failed.items())[:10]
                    if (e := meta.entry(s)) is not None],
            })
        q = p.queue_stats()
        out.update(persisting_files=q["persisting_files"], persisting_bytes=q["persisting_bytes"],
                   oldest_age=q["oldest_age"], upload_errors=q["errors"])
        if rel is None:
            return
        with meta.lock:
            files: list[dict[str, Any]] = []
            for n in meta.inodes():
                if n.is_dir or n.nlink == 0:
                    continue
                fp = meta.path_of(n.ino)
                if barrier.under(fp, rel):
                    # only a file open for writing needs an fstat for its size
                    size = vfs.attr(n).size if n.ino in vfs._wopen else n.size
                    files.append({"path": fp, "state": vfs.state(n), "size": size,
                                  "note": n.local})
            out["files"] = sorted(files, key=lambda f: f["path"])

    def journal(self, limit: int) -> dict:
        total, entries = self.persister.entries(max(1, int(limit)))
        return {"total": total, "entries": entries}

    def journal_skip(self, seq: int, reason: str) -> dict:
        return self.persister.skip(int(seq), _reason(reason))

    def left_dirty(self) -> int:
        with self.meta.lock:
            return self.meta.journal_len()

    def stop_steps(self) -> Steps:
        return [("stopping the persister", self.persister.stop),
                ("closing the metadata", self.meta.close)]


class Clustered:
    """A member of a cluster (acache.cluster): the namespace is the head's, in etcd; this
    node may be the head itself (Member.head)."""
    shared = True

    def __init__(self, member: Member) -> None:
        self.member = member
        self.vfs = member.vfs

    @classmethod
    def open(cls, settings: Settings, cache: CacheDir, under: UnderStore) -> Clustered:
        from acache.cluster.member import Member
        if not settings.listen:
            raise ConfigError(f"meta = {settings.meta} ({settings.source('meta')}) makes this node "
                              "a cluster member: set listen = \"HOST:PORT\" (the address peers "
                              "reach it at; advertise if that differs)")
        node_id = settings.node_id or socket.gethostname().split(".")[0]
        return cls(Member(settings, cache, under, node_id))

    def describe(self) -> str:
        return f"member {self.member.node_id} of {self.member.settings.meta}"

    def barrier(self, rel: str, timeout: float | None, progress) -> dict:
        try:     # the barrier is the head's, for the whole cluster
            r = self.member.call(schema.Flush(path=rel, timeout=timeout))
        except FsError as e:
            raise FlushError(f"the cluster's barrier failed: {e}") from None
        if not r.get("ok", True):
            raise FlushError(r.get("error") or "the cluster's barrier failed")
        return r

    def status(self, rel: str | None, out: dict[str, Any]) -> None:
        m, settings = self.member, self.member.settings
        cluster: dict[str, Any] = {"meta": settings.meta, "node": m.node_id,
                                   "address": m.address, "placement": settings.placement}
        out["read_copy_skipped_bytes"] = self.vfs.fetch.copy_skipped
        out["cluster"] = cluster
        try:
            cluster["nodes"] = m.peers()
        except MetaError as e:
            cluster["error"] = str(e)
        try:
            h = m.call(schema.Status(path=rel))
        except FsError as e:
            h = {"error": f"the head does not answer: {e}"}
        cluster.update(h)
        for n in cluster.get("nodes", []):
            files, size = (h.get("held") or {}).get(n["id"], (0, 0))
            n["held_files"], n["held_bytes"] = files, size
            n["placed_open"] = (h.get("placed_open") or {}).get(n["id"], 0)
        for k in ("queue", "queue_bytes", "in_flight", "rate", "persisted_bytes",
                  "persisted_files", "last_error", "failed"):
            out[k] = h.get(k, 0 if k != "last_error" else h.get("error", ""))
        out["waits_for_writer"] = h.get("waits_for_writer")
        out.update(dirty_files=h.get("queue", 0), failed_entries=[], persisting_files=0,
                   persisting_bytes=0, oldest_age=0, upload_errors={})

    def journal(self, limit: int) -> dict:
        # the journal is the head's, wherever it runs
        return self.member.call(schema.Journal(limit=max(1, int(limit))))

    def journal_skip(self, seq: int, reason: str) -> dict:
        return self.member.call(schema.JournalSkip(seq=int(seq), reason=_reason(reason)))

    def left_dirty(self) -> int:
        return 0

    def stop_steps(self) -> Steps:
        return [("leaving the cluster", self.member.close)]
