"""The VFS: the contract rules over MetaStore + CacheDir + journal, engine-agnostic.

Mount engines (pyfuse3, native /dev/fuse) are thin adapters over this class:
every method is synchronous and thread-safe, takes names as bytes and raises
acache.errors.FsError(errno) for POSIX errors.  Namespace operations live here;
open files (open/read/write/flush/release/fsync) in acache.fs.files.
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
from acache.fs.types import (RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INO, STATE_XATTR, UTIME_NOW,
                             Attr, Ctx, StatFs)
from acache.meta import journal
from acache.meta.store import Inode, MetaStore

log = logging.getLogger("acache.vfs")
NAME_MAX = 255
PATH_MAX = 4096


def _now() -> int:
    return time.time_ns()


class VFS(FileOps):
    ordered_closes = True    # closes that overlapped may commit together (acache.fs.overlap)
    def __init__(self, meta: MetaStore, cache: CacheDir, under: UnderStore, persister: Persister,
                 *, chunk_size: int = 8 << 20) -> None:
        self.meta, self.cache, self.under, self.persister = meta, cache, under, persister
        self.lock = meta.lock
        self.fetch = ReadThrough(under, chunk_size, cache=cache)
        self.fetch.settle = getattr(persister, "wait_moves", None)
        self._init_files()
        self._lookups: dict[int, int] = {}
        self._dirs: dict[int, tuple[int, list]] = {}
        persister.gc = self.gc_gen
        persister.withdraw = self._withdraw_put
        meta.on_freed = self.gc_gen
        cache.evict_hook = self._evict

    def after_failure(self, err: BaseException) -> bool:
        """The mount engines' error edge: an operation failed unexpectedly (the cache disk,
        a bug); undo what it changed in memory without committing (MetaStore.after_failure)."""
        return self.meta.after_failure(err)

    # -- helpers ------------------------------------------------------------------------
    def _node(self, ino: int) -> Inode:
        node = self.meta.get(ino)
        if node is None:
            raise FsError(errno.ENOENT)
        return node

    def _dir(self, ino: int) -> Inode:
        node = self._node(ino)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        return node

    def attr(self, node: Inode) -> Attr:
        size, mtime, blocks = node.size, node.mtime_ns, (node.size + 511) // 512
        ctime = node.ctime_ns
        fd = self._write_fd(node)
        if fd is not None:   # written to now: the cache file's times are the file's
            s = os.fstat(fd)
            size, mtime, blocks = s.st_size, max(mtime, s.st_mtime_ns), s.st_blocks
            ctime = max(ctime, s.st_ctime_ns)
        if node.is_dir:
            size, blocks = 4096, 8
        # ctime is the last change, never the mtime a program set (touch -d, tar, cp -p)
        return Attr(ino=node.ino, mode=node.mode, nlink=node.nlink, uid=node.uid, gid=node.gid,
                    size=size, atime_ns=node.atime_ns, mtime_ns=mtime, ctime_ns=ctime,
                    blocks=blocks)

    def _touch_dir(self, txn, node: Inode) -> None:
        node.mtime_ns = node.ctime_ns = _now()
        txn.save(node)

    def _ensure_listed(self, node: Inode) -> None:
        """Merge a directory's under-storage children into the namespace, once."""
        if node.listed:
            return
        upath = node.upath
        try:
            entries = list(self.under.list_dir(upath)) if upath is not None else []
        except UnderStoreError as e:
            log.error("listing %r in the under-storage failed: %s", upath, e)
            raise FsError(errno.EIO) from None
        with self.lock:
            if node.listed or self.meta.get(node.ino) is None:
                return
            txn = self.meta.txn()
            kids = self.meta.children(node.ino)
            for ent in entries:
                name = ent.name.encode("utf-8", "surrogateescape")
                if name in kids or not name or len(name) > NAME_MAX:
                    continue
                mt = ent.mtime_ns or int(ent.mtime * 1e9) or node.mtime_ns
                child_path = f"{upath}/{ent.name}" if upath else ent.name
                # attributes the store does not know (written by another tool): 0644 files,
                # 0755 directories, owned by the parent's owner
                owner = dict(uid=ent.uid if ent.uid >= 0 else node.uid,
                             gid=ent.gid if ent.gid >= 0 else node.gid)
                if ent.is_dir:
                    child = self.meta.new_inode(txn, mode=st.S_IFDIR | (ent.mode or 0o755), nlink=2,
                                                atime_ns=mt, mtime_ns=mt, ctime_ns=mt, parent=node.ino,
                                                name=name, upath=child_path, cached=True, **owner)
                elif ent.link is not None:
                    target = ent.link.encode("utf-8", "surrogateescape")
                    child = self.meta.new_inode(txn, mode=st.S_IFLNK | 0o777, size=len(target),
                                                atime_ns=mt, mtime_ns=mt, ctime_ns=mt, parent=node.ino,
                                                name=name, upath=child_path, cached=True,
                                                target=target, **owner)
                else:
                    child = self.meta.new_inode(txn, mode=st.S_IFREG | (ent.mode or 0o644), size=ent.size,
                                                atime_ns=mt, mtime_ns=mt, ctime_ns=mt, parent=node.ino,
                                                name=name, upath=child_path, cached=ent.size == 0,
                                                **owner)
                txn.link(node.ino, name, child.ino)
            node.listed = True
            txn.save(node)
            txn.commit()

    def _child(self, parent: int, name: bytes) -> Inode | None:
        if len(name) > NAME_MAX:     # no such name can exist: lookup, unlink, rename...
            raise FsError(errno.ENAMETOOLONG)
        p = self._dir(parent)
        self._ensure_listed(p)
        ino = self.meta.child(parent, name)
        return self.meta.get(ino) if ino is not None else None

    @staticmethod
    def _check_name(name: bytes) -> None:
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        if not name or b"/" in name or name in (b".", b".."):
            raise FsError(errno.EINVAL)

    @staticmethod
    def _group_of_new(p: Inode, ctx: Ctx, mode: int, is_dir: bool = False) -> tuple[int, int]:
        """(gid, mode) of an entry created in ``p`` by ``ctx``: in a set-group-ID directory
        it takes the directory's group, and a new directory keeps the bit (what ext4 and
        every local filesystem do; a group-shared checkpoint tree relies on it)."""
        if not p.mode & st.S_ISGID:
            return ctx.gid, mode
        return p.gid, (mode | st.S_ISGID) if is_dir else mode

    # -- lookups ----------------------------------------------------------------------
    def lookup(self, parent: int, name: bytes, ctx: Ctx | None = None) -> Attr:
        if name == b".":
            return self.getattr(parent)
        if name == b"..":
            node = self._node(parent)
            return self.getattr(node.parent or ROOT_INO)
        node = self._child(parent, name)
        with self.lock:
            if node is None or self.meta.get(node.ino) is None:
                raise FsError(errno.ENOENT)
            self._lookups[node.ino] = self._lookups.get(node.ino, 0) + 1
            return self.attr(node)

    def lookup_fast(self, parent: int, name: bytes) -> Attr | None:
        """lookup() for an engine's event loop, when it needs nothing but memory: never
        waits for the lock or the under-storage.  None when the caller must use lookup()
        (from a worker thread) instead: the lock is busy, ``.``/``..``, or the parent's
        under-storage entries are not merged yet."""
        if name in (b".", b"..") or len(name) > NAME_MAX:
            return None
        if not self.lock.acquire(blocking=False):
            return None
        try:
            p = self.meta.get(parent)
            if p is None or not p.is_dir or not p.listed:
                return None
            ino = self.meta.child(parent, name)
            node = self.meta.get(ino) if ino is not None else None
            if node is None:
                raise FsError(errno.ENOENT)
            self._lookups[node.ino] = self._lookups.get(node.ino, 0) + 1
            return self.attr(node)
        finally:
            self.lock.release()

    def getattr_fast(self, ino: int) -> Attr | None:
        """getattr() for an engine's event loop: None when the lock is busy."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            return self.attr(self._node(ino))
        finally:
            self.lock.release()

    def incref(self, ino: int) -> None:
        with self.lock:
            self._lookups[ino] = self._lookups.get(ino, 0) + 1

    def forget(self, items) -> None:
        with self.lock:
            for ino, n in items:
                left = self._lookups.get(ino, 0) - n
                if left > 0:
                    self._lookups[ino] = left
                else:
                    self._lookups.pop(ino, None)

    def getattr(self, ino: int, fh: int | None = None) -> Attr:
        with self.lock:
            return self.attr(self._node(ino))

    def setattr(self, ino: int, ctx: Ctx | None = None, fh: int | None = None, mode=None, uid=None,
                gid=None, size=None, atime_ns=None, mtime_ns=None) -> Attr:
        if size is not None:
            self._truncate(ino, fh, size)
        with self.lock:
            node = self._node(ino)
            txn = self.meta.txn()
            now = _now()
            if mode is not None:
                node.mode = (node.mode & ~0o7777) | (mode & 0o7777)
            if uid is not None and uid != -1:
                node.uid = uid
            if gid is not None and gid != -1:
                node.gid = gid
            if atime_ns is not None:
                node.atime_ns = now if atime_ns == UTIME_NOW else atime_ns
            if mtime_ns is not None:
                node.mtime_ns = now if mtime_ns == UTIME_NOW else mtime_ns
                fd = self._write_fd(node)
                if fd is not None:   # keep fstat-based answers in step while open for writing
                    os.utime(fd, ns=(node.atime_ns or now, node.mtime_ns))
                    self._sig.pop(ino, None)   # a set mtime says nothing of its bytes
            node.ctime_ns = now
            txn.save(node)
            if {mode, uid, gid, mtime_ns} != {None}:
                journal.on_attrs(self.meta, txn, self.persister, node)
            txn.commit()
            self.persister.wake()
            return self.attr(node)

    # -- creating ---------------------------------------------------------------------
    def mkdir(self, parent: int, name: bytes, mode: int, ctx: Ctx) -> Attr:
        self._check_name(name)
        self._child(parent, name)   # lists the parent once
        with self.lock:
            p = self._dir(parent)
            if self.meta.child(parent, name) is not None:
                raise FsError(errno.EEXIST)
            txn = self.meta.txn()
            now = _now()
            gid, mode = self._group_of_new(p, ctx, mode & 0o7777, is_dir=True)
            node = self.meta.new_inode(txn, mode=st.S_IFDIR | mode, nlink=2, uid=ctx.uid,
                                       gid=gid, atime_ns=now, mtime_ns=now, ctime_ns=now,
                                       parent=parent, name=name, listed=True, cached=True)
            txn.link(parent, name, node.ino)
            p.nlink += 1
            self._touch_dir(txn, p)
            txn.append(op="mkdir", path=self.meta.path_of(node.ino), ino=node.ino)
            txn.commit()
            self._lookups[node.ino] = self._lookups.get(node.ino, 0) + 1
            self.persister.wake()
            return self.attr(node)

    def symlink(self, parent: int, name: bytes, target: bytes, ctx: Ctx) -> Attr:
        """A symbolic link: its target is data, journaled at creation (SYMLINK entry)."""
        self._check_name(name)
        if not target:
            raise FsError(errno.ENOENT)
        if len(target) >= PATH_MAX:
            raise FsError(errno.ENAMETOOLONG)
        self._child(parent, name)   # lists the parent once
        with self.lock:
            p = self._dir(parent)
            if self.meta.child(parent, name) is not None:
                raise FsError(errno.EEXIST)
            txn = self.meta.txn()
            now = _now()
            gid, _ = self._group_of_new(p, ctx, 0o777)
            node = self.meta.new_inode(txn, mode=st.S_IFLNK | 0o777, uid=ctx.uid, gid=gid,
                                       size=len(target), atime_ns=now, mtime_ns=now, ctime_ns=now,
                                       parent=parent, name=name, cached=True, target=target)
            txn.link(parent, name, node.ino)
            self._touch_dir(txn, p)
            txn.append(op="symlink", path=self.meta.path_of(node.ino), ino=node.ino,
                       target=target.decode("utf-8", "surrogateescape"))
            txn.commit()
            self._lookups[node.ino] = self._lookups.get(node.ino, 0) + 1
            self.persister.wake()
            return self.attr(node)

    def readlink(self, ino: int, ctx: Ctx | None = None) -> bytes:
        with self.lock:
            node = self._node(ino)
            if not st.S_ISLNK(node.mode):
                raise FsError(errno.EINVAL)
            return node.target

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, ctx: Ctx) -> Attr:
        if not st.S_ISREG(mode):
            raise FsError(errno.EPERM)
        fh, attr = self.create(parent, name, mode, os.O_WRONLY | os.O_EXCL, ctx)
        self.flush(fh)
        self.release(fh)
        return attr

    # -- removing ---------------------------------------------------------------------
    def unlink(self, parent: int, name: bytes, ctx: Ctx | None = None) -> None:
        node = self._child(parent, name)
        with self.lock:
            if node is None or self.meta.child(parent, name) != node.ino:
                raise FsError(errno.ENOENT)
            if node.is_dir:
                raise FsError(errno.EISDIR)
            txn = self.meta.txn()
            journal.on_delete(self.meta, txn, self.persister, node, self.meta.path_of(node.ino))
            self._unlink_node(txn, parent, name, node)
            txn.commit()
            self._reap(node)
            self.persister.wake()

    def rmdir(self, parent: int, name: bytes, ctx: Ctx | None = None) -> None:
        node = self._child(parent, name)
        if node is None:
            raise FsError(errno.ENOENT)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        self._ensure_listed(node)
        with self.lock:
            if self.meta.child(parent, name) != node.ino:
                raise FsError(errno.ENOENT)
            if self.meta.children(node.ino):
                raise FsError(errno.ENOTEMPTY)
            txn = self.meta.txn()
            journal.on_delete(self.meta, txn, self.persister, node, self.meta.path_of(node.ino))
            self._unlink_node(txn, parent, name, node)
            txn.commit()
            self.persister.wake()

    def _unlink_node(self, txn, parent: int, name: bytes, node: Inode) -> None:
        p = self.meta.get(parent)
        txn.unlink(parent, name)
        if node.is_dir:
            p.nlink -= 1
            txn.drop_inode(node.ino)
        else:
            node.nlink = 0
            node.ctime_ns = _now()
            if self._open_count(node.ino):
                txn.save(node)        # an orphan until its last close; dropped at restart
            else:
                txn.drop_inode(node.ino)
        self._touch_dir(txn, p)

    def _reap(self, node: Inode) -> None:
        """Remove the cache files of an unlinked file nobody has open."""
        if node.nlink == 0 and not self._open_count(node.ino):
            with self.lock:
                if self.meta.get(node.ino) is not None:
                    txn = self.meta.txn()
                    txn.drop_inode(node.ino)
                    txn.commit()
            self.gc_gen(node.ino, node.gen)

    # -- rename -----------------------------------------------------------------------
    def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
               flags: int, ctx: Ctx | None = None) -> None:
        if flags & RENAME_EXCHANGE or flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE):
            raise FsError(errno.EINVAL)
        self._check_name(name_new)
        src = self._child(parent_old, name_old)
        if src is None:
            raise FsError(errno.ENOENT)
        dst = self._child(parent_new, name_new)
        if dst is not None and dst.is_dir:
            self._ensure_listed(dst)
        if src.is_dir:
            self._ensure_listed(src)
        with self.lock:
            if self.meta.child(parent_old, name_old) != src.ino:
                raise FsError(errno.ENOENT)
            dst_ino = self.meta.child(parent_new, name_new)
            dst = self.meta.get(dst_ino) if dst_ino is not None else None
            if dst is not None and dst.ino == src.ino:
                return
            if dst is not None and flags & RENAME_NOREPLACE:
                raise FsError(errno.EEXIST)
            if src.is_dir:
                p = self.meta.get(parent_new)
                while p is not None:       # no moving a directory into itself
                    if p.ino == src.ino:
                        raise FsError(errno.EINVAL)
                    p = self.meta.get(p.parent) if p.ino != ROOT_INO else None
            if dst is not None:
                if src.is_dir and not dst.is_dir:
                    raise FsError(errno.ENOTDIR)
                if not src.is_dir and dst.is_dir:
                    raise FsError(errno.EISDIR)
                if dst.is_dir and self.meta.children(dst.ino):
                    raise FsError(errno.ENOTEMPTY)
            txn = self.meta.txn()
            old_path = self.meta.path_of(src.ino)
            new_parent_path = self.meta.path_of(parent_new)
            new_path = f"{new_parent_path}/{name_new.decode('utf-8', 'surrogateescape')}" \
                if new_parent_path else name_new.decode("utf-8", "surrogateescape")
            replaced_remote = False
            if dst is not None:
                # the rename replaces dst: its pending uploads are cancelled; its object
                # is overwritten by what lands at new_path, or else deleted explicitly
                replaced_remote = journal.on_delete(self.meta, txn, self.persister, dst, new_path,
                                                    append=False)
                self._unlink_node(txn, parent_new, name_new, dst)
                if replaced_remote and dst.is_dir:
                    # an empty directory: removed before the rename lands, so that no
                    # later change to the moved tree can leave it behind
                    txn.append(op="rmdir", path=new_path, ino=dst.ino)
                    replaced_remote = False
            lands = journal.on_rename(self.meta, txn, self.persister, src, old_path, new_path,
                                      atomic_dirs=self.under.atomic_dir_rename,
                                      replaces_remote=replaced_remote)
            if replaced_remote and not lands:
                txn.append(op="rmdir" if dst.is_dir else "delete", path=new_path, ino=dst.ino)
            txn.unlink(parent_old, name_old)
            txn.link(parent_new, name_new, src.ino)
            pold, pnew = self.meta.get(parent_old), self.meta.get(parent_new)
            if src.is_dir and parent_old != parent_new:
                pold.nlink -= 1
                pnew.nlink += 1
            src.parent, src.name = parent_new, name_new
            src.ctime_ns = _now()
            txn.save(src)
            self._touch_dir(txn, pold)
            self._touch_dir(txn, pnew)
            txn.commit()
        if dst is not None:
            self._reap(dst)
        self.persister.wake()

    # -- directories ------------------------------------------------------------------
    def opendir(self, ino: int, ctx: Ctx | None = None) -> int:
        node = self._dir(ino)
        self._ensure_listed(node)
        with self.lock:
            entries = sorted(self.meta.children(ino).items())
            self._fh_next += 1
            self._dirs[self._fh_next] = (ino, entries)
            node.atime_ns = _now()
            return self._fh_next

    def readdir(self, fh: int, offset: int) -> list[tuple[bytes, Attr, int]]:
        with self.lock:
            if fh not in self._dirs:
                raise FsError(errno.EBADF)
            _, entries = self._dirs[fh]
            out = []
            for i in range(offset, len(entries)):
                name, ino = entries[i]
                node = self.meta.get(ino)
                if node is None or self.meta.child(node.parent, name) != ino:
                    continue     # removed since opendir
                out.append((name, self.attr(node), i + 1))
            return out

    def fsyncdir(self, fh: int, datasync: bool) -> None:
        """The namespace lives in the metadata store: syncing it makes entries durable."""
        self.meta.sync()

    def releasedir(self, fh: int) -> None:
        with self.lock:
            self._dirs.pop(fh, None)

    def statfs(self) -> StatFs:
        s = self.cache.statvfs()
        bs = s.f_frsize or 4096
        limit = self.cache.limit // bs
        free = max(0, min(limit - self.cache.used() // bs, s.f_bavail))
        return StatFs(bsize=1 << 20, frsize=bs, blocks=limit, bfree=free, bavail=free,
                      files=1 << 32, ffree=(1 << 32) - len(self.meta._inodes), namemax=NAME_MAX)

    # -- state and xattrs ------------------------------------------------------------------
    def state(self, node: Inode) -> str:
        if node.dirty:
            return "dirty"
        if node.local:
            return "unacknowledged"
        kinds = self.meta.entries_of(node.ino, "put", "mkdir", "symlink", "attrs")
        kinds += self.meta.moves_of(node.ino)     # not under its current name until these land
        if any(e.seq in self.persister.failed for e in kinds):
            return "failed"
        if any(self.persister.state(e.seq) for e in kinds):
            return "persisting"
        return "dirty" if kinds else "persisted"

    def getxattr(self, ino: int, name: bytes) -> bytes:
        with self.lock:
            node = self._node(ino)
            if name == STATE_XATTR:
                return self.state(node).encode()
        raise FsError(errno.ENODATA)

    def listxattr(self, ino: int) -> list[bytes]:
        """No names: the state xattr is computed, not stored, so it is not listed (as
        CephFS does with its virtual ceph.* names) -- else `cp -a`, rsync -X and tar
        --xattrs copy a stale "dirty" out of the mount onto other files."""
        self._node(ino)
        return []

    def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        self._node(ino)
        raise FsError(errno.EPERM if name == STATE_XATTR else errno.ENOTSUP)

    def removexattr(self, ino: int, name: bytes) -> None:
        self._node(ino)
        raise FsError(errno.EPERM if name == STATE_XATTR else errno.ENODATA)

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

    def _evict(self, ino: int, gen: int) -> bool:
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
                node = self.meta.get(ino)
                pending = self.meta.gen_pending(ino, gen)
                current = node is not None and node.gen == gen
                unknown = not pending and ((node is None and ino > last_ino)
                                           or (node is not None and gen > node.gen))
                if unknown and os.stat(self.cache.path(ino, gen)).st_size > 0:
                    lost.append(self.cache.set_aside(ino, gen))
                elif (not pending and not current) or (current and not node.cached):
                    self.cache.remove(ino, gen)
                    out["removed"] += 1
                else:
                    clean = current and not pending and not self.meta.puts_of(ino) \
                        and node.upath is not None and not node.local
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
