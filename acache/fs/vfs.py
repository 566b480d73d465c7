"""One host's file system: the namespace (acache.fs.namespace) and its open files
(acache.fs.files), over MetaStore + CacheDir + journal, engine-agnostic.

Mount engines (pyfuse3, native /dev/fuse) are thin adapters over this class:
every method is synchronous and thread-safe, takes names as bytes and raises
acache.errors.FsError(errno) for POSIX errors.  Here too: what a single host does with its
cache files (which generation to keep, evict, recover after a crash).
"""
from __future__ import annotations

import errno
import logging
import os
import stat as st
import time

from acache.data.cache import CacheDir
from acache.data.persister import Persister
from acache.data.readthrough import ReadThrough
from acache.data.under.base import UnderStore
from acache.errors import AcacheError, FsError, UnderStoreError
from acache.fs.files import FileOps
from acache.fs.namespace import NAME_MAX, PATH_MAX, Namespace
from acache.fs.types import ROOT_INO, Attr, Ctx
from acache.meta import journal
from acache.meta.store import Inode, MetaStore

log = logging.getLogger("acache.vfs")
__all__ = ["VFS", "NAME_MAX", "PATH_MAX"]


class VFS(FileOps):
    ordered_closes = True    # closes that overlapped may commit together (acache.fs.overlap)

    def __init__(self, meta: MetaStore, cache: CacheDir, under: UnderStore, persister: Persister,
                 *, chunk_size: int = 8 << 20) -> None:
        Namespace.__init__(self, meta, cache, under, persister)
        self.fetch = ReadThrough(under, chunk_size, cache=cache)
        self.fetch.settle = getattr(persister, "wait_moves", None)
        self._init_files()
        persister.attach(self)
        meta.attach(self)
        cache.attach(self)

    def after_failure(self, err: BaseException) -> bool:
        """The mount engines' error edge: an operation failed unexpectedly (the cache disk,
        a bug); undo what it changed in memory without committing (MetaStore.after_failure)."""
        return self.meta.after_failure(err)

    def _mtime_set(self, node: Inode) -> None:
        fd = self._write_fd(node)
        if fd is not None:   # keep fstat-based answers in step while open for writing
            os.utime(fd, ns=(node.atime_ns or time.time_ns(), node.mtime_ns))
            self._sig.pop(node.ino, None)   # a set mtime says nothing of its bytes

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, ctx: Ctx) -> Attr:
        if not st.S_ISREG(mode):
            raise FsError(errno.EPERM)
        fh, attr = self.create(parent, name, mode, os.O_WRONLY | os.O_EXCL, ctx)
        self.flush(fh)
        self.release(fh)
        return attr

    # -- cache files ------------------------------------------------------------------------
    def gc_gen(self, ino: int, gen: int) -> None:
        """Decide the fate of one cache file: keep, mark clean, or remove (under the lock)."""
        with self.lock:
            node = self.meta.get(ino)
            if self.meta.gen_pending(ino, gen) or self.persister.uses(ino, gen):
                return
            if node is not None and node.gen == gen:
                if not node.dirty and not self.meta.puts_of(ino) and node.upath is not None \
                        and node.cached and not node.local:
                    self.cache.note(ino, gen, dirty=False)
                return
            if self.cache.is_open(ino, gen):
                return
            self.fetch.forget(ino, gen)
            self.cache.remove(ino, gen)

    def evict_cached(self, ino: int, gen: int) -> bool:
        with self.lock:
            node = self.meta.get(ino)
            if node is None or node.gen != gen or node.dirty or node.local or self.meta.puts_of(ino) \
                    or node.upath is None or self.cache.is_open(ino, gen) or self._opens.get(ino) \
                    or self._pins.get(ino):
                return False
            node.cached = False
            txn = self.meta.txn()
            txn.save(node)
            try:
                txn.commit()
            except AcacheError:      # undone (logged): the file stays cached
                return False
            self.fetch.forget(ino, gen)
            self.cache.remove(ino, gen)
            return True

    # -- restart -----------------------------------------------------------------------------
    def recover(self) -> dict:
        """After a crash: clean half-done stages, re-journal files that were open for
        writing (their bytes were acknowledged by close or fsync), drop orphans, and
        reconcile cache files with the namespace: a cache file the metadata does not know
        (lost metadata: a deleted or damaged WAL) is moved to lost+found, never deleted."""
        out = {"stages": 0, "reopened": 0, "orphans": 0, "removed": 0, "lost+found": 0}
        with self.lock:
            tokens = [e.token for e in self.meta.journal() if e.token]
            orphans = self.meta.orphan_stages()
        cleaned = set()
        for token in tokens + orphans:     # under-storage calls: outside the lock
            try:
                self.under.cleanup(token)
                cleaned.add(token)
            except UnderStoreError as err:   # unreachable now: the token stays, and the
                log.warning("cleaning up after the stage %s failed: %s", token, err)
                # store cleans up before it stages the path
        with self.lock:
            txn = self.meta.txn()
            for e in self.meta.journal():
                if e.token and e.token in cleaned:
                    e.token = ""
                    txn.update_entry(e)
                    out["stages"] += 1
            for token in orphans:             # of entries cancelled mid-stage
                if token in cleaned:
                    txn.forget_stage(token)
                    out["stages"] += 1
            known = self.cache.known()
            out["detached"] = self._drop_detached(txn, known)
            for node in self.meta.inodes():
                if node.is_dir:
                    continue
                if not node.dirty and node.cached and node.size and node.upath is not None \
                        and (node.ino, node.gen) not in known \
                        and not self.meta.gen_pending(node.ino, node.gen):
                    node.cached = False       # its cache file is gone: read it through again
                    txn.save(node)
                if node.nlink == 0:
                    txn.drop_inode(node.ino)
                    out["orphans"] += 1
                elif node.dirty:
                    self._recover_dirty(txn, node)
                    out["reopened"] += 1
            txn.commit(sync=True)
            last_ino = self.meta.last_ino()
            lost = []
            for ino, gen in known:
                cur = self.meta.get(ino)
                pending = self.meta.gen_pending(ino, gen)
                current = cur is not None and cur.gen == gen
                unknown = not pending and ((cur is None and ino > last_ino)
                                           or (cur is not None and gen > cur.gen))
                if unknown and os.stat(self.cache.path(ino, gen)).st_size > 0:
                    lost.append(self.cache.set_aside(ino, gen))
                elif (not pending and not current) or (cur is not None and current
                                                       and not cur.cached):
                    self.cache.remove(ino, gen)
                    out["removed"] += 1
                else:
                    clean = cur is not None and current and not pending \
                        and not self.meta.puts_of(ino) and cur.upath is not None and not cur.local
                    self.cache.note(ino, gen, dirty=not clean)
            if lost:
                out["lost+found"] = len(lost)
                log.warning("%d cache files are not known to the metadata (was its log deleted "
                            "or damaged?): moved to %s, nothing deleted; they hold data of files "
                            "the mount no longer shows: %s", len(lost), self.cache.lost_dir,
                            ", ".join(os.path.basename(p) for p in lost[:20]))
        return out

    def _drop_detached(self, txn, known: set) -> int:
        """Inodes no name reaches (a missing directory above them) and directory entries
        naming a missing inode: no path can be given to them, so they cannot stay in the
        namespace (every path_of would fail).  What the cache holds of a detached file
        that is not journaled (open for writing, unacknowledged) goes to lost+found;
        journaled PUTs carry their own path and still land.  Returns how many."""
        meta, bad, ok = self.meta, [], {ROOT_INO}
        for node in meta.inodes():
            if node.nlink == 0 and not node.is_dir:
                continue          # an orphan: dropped below in any case, no path asked
            chain, ino = [], node.ino
            while ino not in ok:
                cur = meta.get(ino)
                if cur is None or ino in chain:    # missing, or a loop
                    break
                chain.append(ino)
                ino = cur.parent
            if ino in ok:
                ok.update(chain)
            else:
                bad.append(node)
        for node in bad:
            if not node.is_dir:
                log.error("recovery: inode %d (%r, in directory inode %d) has no path: a directory "
                          "above it is missing from the metadata; it is taken out of the namespace",
                          node.ino, node.name.decode("utf-8", "surrogateescape"), node.parent)
                if (node.dirty or node.local or node.upath is None) and (node.ino, node.gen) in known \
                        and not self.meta.gen_pending(node.ino, node.gen):
                    where = self.cache.set_aside(node.ino, node.gen)
                    known.discard((node.ino, node.gen))
                    log.error("recovery: its unpersisted content is kept at %s", where)
            txn.drop_inode(node.ino)
        for parent in meta.parents():
            for name, ino in list(meta.children(parent).items()):
                if meta.get(parent) is None or meta.get(ino) is None:
                    log.error("recovery: directory entry %r of inode %d names inode %d, which is "
                              "missing: removed", name.decode("utf-8", "surrogateescape"), parent, ino)
                    txn.unlink(parent, name)
        return len(bad)

    def _recover_dirty(self, txn, node: Inode) -> None:
        """A file open for writing when the node died: journal what was acknowledged.
        Fsynced since it was opened: published (at least the fsynced bytes; what a local
        disk would keep).  Never fsynced: nothing of what it holds was acknowledged, so it
        is not published as if complete; it stays in the cache as it is, shown
        'unacknowledged', and the under-storage keeps its last closed version (a PUT of it
        that is still pending lands; one held for this writer is withdrawn, its bytes
        were being changed in place)."""
        if node.synced < 0:
            for e in self.meta.puts_of(node.ino):
                if e.gen == node.gen and self.persister.state(e.seq) != "committing":
                    txn.remove_entry(e.seq)    # held for this writer: its bytes changed
            try:
                s = os.stat(self.cache.path(node.ino, node.gen))
                node.size, node.mtime_ns = s.st_size, max(node.mtime_ns, s.st_mtime_ns)
                node.ctime_ns = max(node.ctime_ns, s.st_ctime_ns)
            except FileNotFoundError:
                self.cache.create_empty(node.ino, node.gen)
                node.size = 0
            node.dirty, node.cached = False, True
            node.local = "unacknowledged (crash while open for writing, never fsynced)"
            log.warning("%s was open for writing at a crash and never fsynced: kept in the cache "
                        "as it is (%d bytes), not published; close it again to persist it",
                        self.meta.path_of(node.ino), node.size)
            txn.save(node)
            return
        try:
            s = os.stat(self.cache.path(node.ino, node.gen))
            size, mtime = s.st_size, s.st_mtime_ns
            node.ctime_ns = max(node.ctime_ns, s.st_ctime_ns)
        except FileNotFoundError:
            size, mtime = -1, 0
        if size < node.synced:   # missing or short: the PUT fails and says so, never uploads less
            log.error("the cache file of %s (%s) is %s: %d bytes were fsynced; it is not "
                      "persisted from it", self.meta.path_of(node.ino),
                      self.cache.path(node.ino, node.gen),
                      "missing" if size < 0 else f"short ({size} bytes)", node.synced)
            node.size = node.synced
        else:
            node.size, node.mtime_ns = max(size, 0), max(node.mtime_ns, mtime)
        journal.journal_put(self.meta, txn, self.persister, node)
        node.dirty = False
        node.synced = -1
        txn.save(node)
