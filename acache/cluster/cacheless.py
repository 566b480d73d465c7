"""CachelessVFS: the mount of a node without a cache (``placement = "hash"``, ``acache mount
--no-cache``).

The namespace is the head's, as for every member (acache.cluster.client.ClientVFS, which
this extends); the bytes are never on this host:

* a file opened for writing gets a new generation placed by the head on a live worker
  (rendezvous hashing of the inode over the live workers: acache.cluster.placement), which
  is recorded as its holder.  This node opens a write session on that worker
  (``data.open``, acache.cluster.worker) and streams its writes there
  (acache.cluster.remote_write: coalesced, pipelined, at most ``window`` bytes of a file
  unacknowledged, overlapping writes in order).
* fsync = every write acknowledged, ``data.fsync`` on the worker (durable on its disk), then
  the head's fsync record with the size the worker reports; close = every write
  acknowledged, then the head's close (the journal's PUT) with the worker's size.
* reads come from the holder's cache (or the under-storage once persisted) through a
  RemoteFile: a few chunks of read-ahead in memory, no cache file here.
* a worker that dies (or answers an error) fails the files written to it -- every later
  write, fsync and close of them is EIO -- and nothing else; what an fsync acknowledged is on
  its disk and is published when it rejoins (HeadNamespace.rejoin).

Not supported here: fallocate (EOPNOTSUPP), mmap writes through a shared mapping are plain
writes as with any FUSE file without writeback caching.
"""
from __future__ import annotations

import errno
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from acache.cluster.client import ClientVFS, _ctx
from acache.cluster.remote_write import RemoteWriter
from acache.errors import FsError, NewFile, UnderStoreError
from acache.fs.types import Attr, StatFs
from acache.fs.namespace import NAME_MAX
from acache.net.transport import RemoteError, TransportError

if TYPE_CHECKING:
    from acache.net.remote_file import RemoteFile

log = logging.getLogger("acache.cluster.cacheless")


@dataclass
class _CHandle:
    fh: int
    ino: int
    gen: int
    writable: bool
    writing: _RWriting | None = None      # set on every writable handle
    rfile: RemoteFile | None = None       # reads
    src: dict | None = None               # where the reads come from (to ask again)
    append: bool = False
    closed: bool = False


@dataclass
class _RWriting:
    gen: int
    writer: RemoteWriter
    handles: set = field(default_factory=set)
    active: set = field(default_factory=set)


class _UnderConn:
    """The under-storage as a RemoteFile's Conn: ``read_into`` of a range of one object."""

    def __init__(self, under, upath: str) -> None:
        self.under, self.upath = under, upath

    def read_into(self, op: str, meta: dict, buf: memoryview, *,
                  timeout: float | None = None) -> int:
        data = self.under.read(self.upath, meta["offset"], meta["length"])
        buf[:len(data)] = data
        return len(data)


class CachelessVFS(ClientVFS):
    if TYPE_CHECKING:
        # every handle here is a _CHandle (never a ClientVFS _Handle): the table and _new are
        # typed so; the ClientVFS methods that use a _Handle's own fields are all overridden
        _handles: dict[int, _CHandle]  # type: ignore[assignment]

        def _new(self, h: _CHandle) -> int: ...  # type: ignore[override]

    def __init__(self, node_id: str, cache, under, ns, peer, *, chunk_size: int = 8 << 20,
                 window: int = 16 << 20, piece: int = 1 << 20, senders: int = 16,
                 read_chunk: int = 4 << 20, readahead: int = 2) -> None:
        super().__init__(node_id, cache, under, ns, peer, chunk_size=chunk_size)
        self.window, self.piece = window, piece
        self.read_chunk, self.readahead = read_chunk, readahead
        self.senders = senders
        # one pool of sender threads per worker: a slow worker's backlog holds its own
        # threads, never those that feed the others
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._rw: dict[int, _RWriting] = {}          # ino -> this node's write session

    def passthrough_fd(self, fh: int, opening: bool = False) -> int | None:
        return None      # no cache file here: every byte goes to or comes from a worker

    def _pool(self, holder: str) -> ThreadPoolExecutor:
        with self.lock:
            p = self._pools.get(holder)
            if p is None:
                p = self._pools[holder] = ThreadPoolExecutor(
                    self.senders, thread_name_prefix=f"acache-write-{holder}")
            return p

    def close(self) -> None:
        with self.lock:
            pools, self._pools = list(self._pools.values()), {}
        for p in pools:
            p.shutdown(wait=False, cancel_futures=True)

    # -- attributes: a file written here is as long as what was written ---------------------
    def _overlay(self, a: Attr) -> Attr:
        w = self._rw.get(a.ino)
        if w is not None:
            a.size = w.writer.size
            a.blocks = (a.size + 511) // 512
            a.mtime_ns = max(a.mtime_ns, w.writer.mtime_ns)
            a.ctime_ns = max(a.ctime_ns, w.writer.mtime_ns)
        return a

    def setattr(self, ino, ctx=None, fh=None, mode=None, uid=None, gid=None, size=None,
                atime_ns=None, mtime_ns=None) -> Attr:
        if size is not None:
            self._truncate(ino, fh, size)
        if {mode, uid, gid, atime_ns, mtime_ns} == {None}:
            return self.getattr(ino)
        return self._overlay(self._attr(self.ns("setattr", ino=ino, mode=mode, uid=uid, gid=gid,
                                                atime_ns=atime_ns, mtime_ns=mtime_ns,
                                                ctx=_ctx(ctx))))

    def statfs(self) -> StatFs:
        # the bytes are on the workers: no local limit applies
        return StatFs(bsize=1 << 20, frsize=4096, blocks=1 << 40, bfree=1 << 40, bavail=1 << 40,
                      files=1 << 32, ffree=(1 << 32) - 1, namemax=NAME_MAX)

    # -- handles --------------------------------------------------------------------------
    def _handle(self, fh: int) -> _CHandle:  # type: ignore[override]  # its handles (above)
        h = self._handles.get(fh)
        if h is None:
            raise FsError(errno.EBADF)
        return h

    def _open_write(self, ino: int, r: dict) -> int:
        gen, holder, trunc = r["gen"], r.get("holder") or "", bool(r.get("trunc"))
        with self.lock:
            w = self._rw.get(ino)
        if w is None or w.gen != gen:
            try:
                if not holder or holder == self.node_id:
                    raise FsError(errno.EIO, f"inode {ino} was not placed on a worker")
                conn = self.peer(holder)
                reply, _ = conn.request("data.open", {"ino": ino, "gen": gen, "src": r.get("src"),
                                                      "trunc": trunc})
            except (TransportError, OSError, FsError) as e:
                log.error("inode %d: opening its write session on worker %s failed: %s: EIO",
                          ino, holder, e)
                self.ns("end_write", ino=ino, gen=gen)
                raise FsError(errno.EIO) from None
            writer = RemoteWriter(conn, ino, gen, holder, int(reply.get("size", 0)), pool=self._pool(holder),
                                  window=self.window, piece=self.piece)
            with self.lock:
                w = self._rw[ino] = _RWriting(gen, writer)
        elif trunc:
            w.writer.truncate(0)
        h = _CHandle(0, ino, gen, True, writing=w)
        fh = self._new(h)
        with self.lock:
            w.handles.add(fh)
            w.active.add(fh)
        return fh

    def create(self, parent: int, name: bytes, mode: int, flags: int, ctx) -> tuple[int, Attr]:
        r = self.ns("create", parent=parent, name=name, mode=mode, flags=flags, ctx=_ctx(ctx),
                    place=True)
        r["trunc"] = bool(flags & os.O_TRUNC)
        with self._ino_lock(r["ino"]):
            fh = self._open_write(r["ino"], r)
        self._handles[fh].append = bool(flags & os.O_APPEND)
        return fh, self._overlay(self._attr(r["attr"]))

    def open(self, ino: int, flags: int, ctx=None, same_file: bool = False) -> int:
        if (flags & os.O_ACCMODE) != os.O_RDONLY:
            if same_file:
                raise NewFile()    # never asked: nothing here is passed through
            trunc = bool(flags & os.O_TRUNC)
            with self._ino_lock(ino):
                r = self.ns("open_write", ino=ino, trunc=trunc, place=True)
                r["trunc"] = trunc
                fh = self._open_write(ino, r)
            self._handles[fh].append = bool(flags & os.O_APPEND)
            return fh
        with self.lock:
            w = self._rw.get(ino)
        if w is not None:        # written here: read it back from the worker, as written
            return self._new(_CHandle(0, ino, w.gen, False, writing=w))
        r = self.ns("open_read", ino=ino)
        h = _CHandle(0, ino, r["gen"], False, src=r)
        try:
            h.rfile = self._rfile(ino, r)
        except BaseException:
            self.ns("end_read", ino=ino, gen=r["gen"])
            raise
        return self._new(h)

    def _rfile(self, ino: int, src: dict) -> RemoteFile | None:
        from acache.net.remote_file import ReadsInto, RemoteFile
        size, holder = src["size"], src.get("holder") or ""
        if size == 0:
            return None
        conn: ReadsInto
        if src.get("cached") and holder:
            try:
                conn = self.peer(holder)
            except TransportError as e:
                log.error("inode %d: its holder %s is unreachable: %s", ino, holder, e)
                raise FsError(errno.EIO) from None
            meta = {"ino": ino, "gen": src["gen"]}
        elif src.get("upath") is not None:
            conn, meta = _UnderConn(self.under, src["upath"]), {}
        else:
            raise FsError(errno.EIO, f"no copy of inode {ino} is reachable")
        return RemoteFile(conn, "data.read", meta, size, chunk=self.read_chunk,
                          parallel=self.readahead + 1, readahead=self.readahead)

    # -- data ---------------------------------------------------------------------------------
    def read(self, fh: int, offset: int, size: int) -> bytes:
        h = self._handle(fh)
        if h.writing is not None:          # this node's own file being written
            return self._read_back(h, offset, size)
        for attempt in (0, 1):
            if h.rfile is None:            # an empty generation: nothing to read
                return b""
            try:
                return bytes(h.rfile.pread(offset, size))
            except RemoteError as e:
                if e.errno != errno.ENOENT or attempt:
                    log.error("inode %d: reading from its holder failed: %s", h.ino, e)
                    raise FsError(errno.EIO) from None
                # evicted there after it was persisted: the under-storage has it now
                src = self.ns("open_read", ino=h.ino)
                self.ns("end_read", ino=h.ino, gen=src["gen"])
                if src["gen"] != h.gen or src.get("upath") is None:
                    raise FsError(errno.EIO) from None
                h.rfile.close()
                h.rfile = self._rfile(h.ino, {**src, "cached": False})
            except (TransportError, UnderStoreError) as e:
                log.error("inode %d: reading failed: %s", h.ino, e)
                raise FsError(errno.EIO) from None
        raise FsError(errno.EIO)

    def _read_back(self, h: _CHandle, offset: int, size: int) -> bytes:
        assert h.writing is not None              # read() calls it for a handle written here
        wr = h.writing.writer
        wr.drain()
        n = max(0, min(size, wr.size - offset))
        if n == 0:
            return b""
        buf = bytearray(n)
        try:
            got = wr.conn.read_into("data.read", {"ino": h.ino, "gen": h.gen, "offset": offset,
                                                  "length": n}, memoryview(buf))
        except TransportError as e:
            log.error("inode %d: reading back from worker %s failed: %s", h.ino, wr.holder, e)
            raise FsError(errno.EIO) from None
        return bytes(buf[:got])

    def read_fast(self, fh: int, offset: int, size: int):
        return None

    def write(self, fh: int, offset: int, data) -> int:
        h = self._handle(fh)
        if not h.writable or h.writing is None:
            raise FsError(errno.EBADF)
        if h.closed:
            self._written_after_close(h)
        wr = h.writing.writer
        if h.append:          # O_APPEND: at the end of what this session wrote
            with self._ino_lock(h.ino):
                return wr.write(wr.size, data)
        return wr.write(offset, data)

    def _written_after_close(self, h: _CHandle) -> None:  # type: ignore[override]  # (above)
        """A FLUSH came from a close(2) of a copy of the fd (a fork of the writing process
        closes its child's copies; a dup) and the file is written on: it is open again, and
        the next FLUSH closes it again with what came since.  The head must know (as for a
        node with a cache, ClientVFS._written_after_close): it cancels the PUT that FLUSH
        journaled and marks the file dirty again.  Otherwise that PUT of the size at the
        fork lands as the file's content, and if the worker then dies, what an fsync
        acknowledged after it is never published (the worker's restart finds the file clean)."""
        with self.lock:
            if not h.closed:
                return
            h.closed = False
            if h.writing is not None:
                h.writing.active.add(h.fh)
        self.ns("reopen", ino=h.ino, gen=h.gen)

    def write_fast(self, fh: int, offset: int, data):
        return None

    def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        raise FsError(errno.EOPNOTSUPP)

    def _truncate(self, ino: int, fh, size: int) -> None:
        with self.lock:
            w = self._rw.get(ino)
            h = self._handles.get(fh) if fh is not None else None
        if w is not None:
            if h is not None and h.writable and h.closed:
                self._written_after_close(h)
            w.writer.truncate(size)
            return
        fh = self.open(ino, os.O_WRONLY | (os.O_TRUNC if size == 0 else 0))
        try:
            if size:
                w = self._handles[fh].writing
                assert w is not None              # a write open's handle
                w.writer.truncate(size)
            self.flush(fh)
        finally:
            self.release(fh)

    # -- close / fsync ------------------------------------------------------------------------
    def _close_at_head(self, h: _CHandle) -> None:
        assert h.writing is not None              # a writable handle
        s = h.writing.writer.close()
        self.ns("close", ino=h.ino, gen=h.gen, size=s["size"], mtime_ns=s["mtime_ns"],
                ctime_ns=s["ctime_ns"])

    def flush(self, fh: int, unique: int = 0) -> None:
        with self.lock:
            h = self._handles.get(fh)
            if h is None or not h.writable or h.closed:
                return
            h.closed = True
            w = h.writing
            assert w is not None                  # a writable handle
            w.active.discard(fh)
            last = not w.active
        if last:
            try:
                self._close_at_head(h)
            except BaseException:
                # not journaled: the next FLUSH or the RELEASE tries again (ClientVFS.flush)
                with self.lock:
                    if self._handles.get(fh) is h:
                        h.closed = False
                        w.active.add(fh)
                raise

    def fsync(self, fh: int, datasync: bool) -> None:
        h = self._handle(fh)
        if h.writing is None:
            return
        s = h.writing.writer.fsync()
        if h.writable:
            self.ns("fsync", ino=h.ino, gen=h.gen, size=s["size"], mtime_ns=s["mtime_ns"])

    def release(self, fh: int) -> None:
        with self.lock:
            h = self._handles.pop(fh, None)
            if h is None:
                return
            ended = False
            if h.writable:
                w = h.writing
                assert w is not None              # a writable handle
                w.handles.discard(fh)
                w.active.discard(fh)
                if not w.handles and self._rw.get(h.ino) is w:
                    del self._rw[h.ino]
                    ended = True
        if h.writable:
            if not h.closed:       # a RELEASE without FLUSH: close it now, so it is journaled
                try:
                    self._close_at_head(h)
                except FsError as e:
                    log.error("inode %d: closing at release failed: %s", h.ino, e)
            if ended:
                with self._ino_lock(h.ino):
                    with self.lock:
                        reopened = h.ino in self._rw
                    assert h.writing is not None
                    h.writing.writer.end()
                    if not reopened:
                        self.ns("end_write", ino=h.ino, gen=h.gen)
        elif h.writing is None:
            if h.rfile is not None:
                h.rfile.close()
            self.ns("end_read", ino=h.ino, gen=h.gen)

    def flush_handle_on_release(self, h) -> None:      # not used: release closes itself
        self._close_at_head(h)

    def local_files(self) -> dict[int, tuple[int, int]]:
        return {}

    def recover(self) -> dict:
        return {"cache_files": 0}
