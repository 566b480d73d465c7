"""The namespace: the contract's rules for names and attributes over MetaStore + journal +
persister (DESIGN.md points 1-4), whoever has the files open.

One class for one host and for the cluster's head.  Open files are not here: what the
namespace needs to know of them it asks through four hooks, which the open-file layer above
fills in -- one host's (acache.fs.files.FileOps: this process's handles) or the head's
(acache.cluster.head.HeadNamespace: the cluster's write and read sessions):

- ``_open_count(ino)``: open anywhere (an unlinked file stays an orphan until its last close);
- ``_write_fd(node)``: the cache file being written here, whose fstat is the file's size;
- ``_truncate(ino, fh, size)``: setattr's size, which only an open-file layer can apply;
- ``_mtime_set(node)``: a set mtime, which that layer may need to carry to its cache file;
- ``gc_gen(ino, gen)``: a generation may be unneeded now (unlink, rename over, reap).

Every method is synchronous and thread-safe (the store's lock), takes names as bytes and
raises acache.errors.FsError(errno) for POSIX errors.
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import stat as st
import time

from acache.data.cache import CacheDir
from acache.data.persister import Persister
from acache.data.under.base import UnderStore
from acache.errors import FsError, UnderStoreError
from acache.fs.api import Base
from acache.fs.types import (RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INO, STATE_XATTR, UTIME_NOW,
                             Attr, Ctx, StatFs)
from acache.meta import journal
from acache.meta.store import Inode, MetaStore

log = logging.getLogger("acache.vfs")
NAME_MAX = 255
PATH_MAX = 4096


def _now() -> int:
    return time.time_ns()


class Namespace(Base):
    """Names, attributes and directories of one MetaStore, with the journal's rules."""

    def __init__(self, meta: MetaStore, cache: CacheDir, under: UnderStore,
                 persister: Persister) -> None:
        self.meta, self.cache, self.under, self.persister = meta, cache, under, persister
        self.lock = meta.lock
        self._dirs: dict[int, tuple[int, list]] = {}
        self._dir_fhs = itertools.count(1)

    # -- what the open-file layer tells (see the module's docstring) ------------------------
    def _open_count(self, ino: int) -> int:
        return 0

    def _write_fd(self, node: Inode) -> int | None:
        return None

    def _truncate(self, ino: int, fh: int | None, size: int) -> None:
        raise FsError(errno.EINVAL)        # no open-file layer: sizes come with closes

    def _mtime_set(self, node: Inode) -> None:
        return None

    def gc_gen(self, ino: int, gen: int) -> None:
        return None

    def _newest_unstarted(self, ino: int, gen: int) -> bool:
        """Is generation ``gen``'s pending PUT the journal's newest entry, not started?  Then
        nothing can overtake it: a writer may write its cache file in place."""
        pend = [e for e in self.meta.puts_of(ino) if e.gen == gen]
        return bool(pend) and self.meta.newest_seq() == pend[-1].seq \
            and not self.persister.uses(ino, gen) \
            and all(self.persister.state(e.seq) == "" for e in pend)

    def list_page(self, ino: int, offset: int, limit: int) -> tuple[list[tuple[bytes, Attr, int]], bool]:
        """Up to ``limit`` entries of directory ``ino`` from ``offset`` (readdir's offsets),
        and whether more follow: one page of a listing, for a caller that keeps no handle."""
        fh = self.opendir(ino)
        try:
            part = self.readdir(fh, offset)
        finally:
            self.releasedir(fh)
        return part[:limit], len(part) > limit

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
            return self.getattr(self._node(parent).parent or ROOT_INO)
        node = self._child(parent, name)
        with self.lock:
            if node is None or self.meta.get(node.ino) is None:
                raise FsError(errno.ENOENT)
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
                self._mtime_set(node)
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
            self.persister.wake()
            return self.attr(node)

    def readlink(self, ino: int, ctx: Ctx | None = None) -> bytes:
        with self.lock:
            node = self._node(ino)
            if not st.S_ISLNK(node.mode):
                raise FsError(errno.EINVAL)
            return node.target

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
        assert p is not None             # checked by the caller, under the lock
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
                assert dst is not None
                txn.append(op="rmdir" if dst.is_dir else "delete", path=new_path, ino=dst.ino)
            txn.unlink(parent_old, name_old)
            txn.link(parent_new, name_new, src.ino)
            pold, pnew = self.meta.get(parent_old), self.meta.get(parent_new)
            assert pold is not None and pnew is not None     # both listed above, lock held
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
            fh = next(self._dir_fhs)
            self._dirs[fh] = (ino, entries)
            node.atime_ns = _now()
            return fh

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
