"""The native engine's replies without a mount: READDIR(PLUS) sizes and continuation
(Ops over a MemVFS), and the session's reply edge and INTERRUPT handling (a Session
writing into one end of a socket pair, read back message by message)."""
from __future__ import annotations

import errno
import os
import socket
import stat
import threading

from acache.errors import FsError
from acache.fs.native import proto
from acache.fs.native.ops import Ops
from acache.fs.native.passthrough import OpenTable
from acache.fs.native.session import Request, Session
from acache.fs.types import ROOT_INO, Ctx

try:
    from .test_native_memvfs import MemVFS
except ImportError:
    from test_native_memvfs import MemVFS

ENTRY_SIZE = len(proto.pack_entry(None, 0, 0))


def _dir_with(tmp_path, n: int) -> tuple[MemVFS, Ops, int, set[bytes]]:
    vfs = MemVFS(str(tmp_path / "cache"))
    ctx = Ctx()
    d = vfs.mkdir(ROOT_INO, b"d", 0o755, ctx).ino
    names = {f"rank-{i:05d}-{'x' * (i % 37)}.distcp".encode() for i in range(n)}
    for name in names:
        fh, _ = vfs.create(d, name, stat.S_IFREG | 0o644, os.O_WRONLY, ctx)
        vfs.release(fh)
    for node in vfs.nodes.values():
        node.lookups = 0                  # only what READDIRPLUS hands out counts below
    return vfs, Ops(vfs, OpenTable(-1, False)), d, names


def _parse(reply: bytes, plus: bool) -> list[tuple[bytes, int, int]]:
    """(name, ino, next offset) of each whole entry; the reply must hold nothing else."""
    out, pos = [], 0
    while pos < len(reply):
        if plus:
            pos += ENTRY_SIZE
        ino, off, namelen, _typ = proto.DIRENT.unpack_from(reply, pos)
        pos += proto.DIRENT.size
        out.append((reply[pos:pos + namelen], ino, off))
        pos += namelen + (-(proto.DIRENT.size + namelen) % proto.DIRENT_ALIGN)
    assert pos == len(reply), "a partial entry at the end of the reply"
    return out


def _list(ops: Ops, d: int, size: int, plus: bool) -> list[tuple[bytes, int, int]]:
    fh = proto.OPEN_OUT.unpack(ops.opendir(Request(1, proto.OPENDIR, d, 0, 0, 0,
                                                   memoryview(bytes(8)))).parts)[0]
    got, offset, unique = [], 0, 10
    while True:
        body = memoryview(proto.READ_IN.pack(fh, offset, size, 0, 0, 0, 0))
        op = proto.READDIRPLUS if plus else proto.READDIR
        res = (ops.readdirplus if plus else ops.readdir)(Request(unique, op, d, 0, 0, 0, body))
        reply = res.parts if plus else res
        assert isinstance(reply, bytes) and len(reply) <= size
        entries = _parse(reply, plus)
        if not entries:
            return got
        got += entries
        offset = entries[-1][2]
        unique += 1


def test_readdir_replies_fit_the_size_asked_and_continue(tmp_path):
    vfs, ops, d, names = _dir_with(tmp_path, 3000)
    for size in (4096, 32768, 1 << 20):
        got = _list(ops, d, size, plus=False)
        assert [g[0] for g in got[:2]] == [b".", b".."]
        assert sorted(g[0] for g in got[2:]) == sorted(names)      # each exactly once
        offs = [g[2] for g in got]
        assert offs == sorted(set(offs))                           # cookies only grow


def test_readdirplus_counts_lookups_only_for_entries_sent(tmp_path):
    vfs, ops, d, names = _dir_with(tmp_path, 1500)
    sent = _list(ops, d, 4096, plus=True)
    assert sorted(g[0] for g in sent[2:]) == sorted(names)
    by_ino = {ino: n for n, ino, _ in sent[2:]}
    for node in vfs.nodes.values():
        if node.ino in by_ino:
            assert node.lookups == 1, (by_ino[node.ino], node.lookups)
    # one reply of a 4 KiB request holds ~24 of them: the rest got no reference
    vfs2, ops2, d2, _ = _dir_with(tmp_path / "b", 200)
    fh = proto.OPEN_OUT.unpack(ops2.opendir(Request(1, proto.OPENDIR, d2, 0, 0, 0,
                                                    memoryview(bytes(8)))).parts)[0]
    body = memoryview(proto.READ_IN.pack(fh, 0, 4096, 0, 0, 0, 0))
    reply = ops2.readdirplus(Request(2, proto.READDIRPLUS, d2, 0, 0, 0, body)).parts
    n = len(_parse(reply, True)) - 2
    assert 0 < n < 200
    assert sum(node.lookups for node in vfs2.nodes.values() if node.ino not in (1, d2)) == n


def test_lookup_of_a_missing_name_is_a_negative_entry_the_kernel_may_keep(tmp_path):
    """A miss is answered with nodeid 0 and the names' timeout (the kernel keeps it and
    sends no LOOKUP again before a create), except where other hosts change the namespace."""
    vfs, _, d, _ = _dir_with(tmp_path, 1)
    ops = Ops(vfs, OpenTable(-1, False), entry_timeout=60.0)
    req = Request(3, proto.LOOKUP, d, 0, 0, 0, memoryview(b"missing\0"))
    nodeid, gen, entry_valid, attr_valid, _, _ = proto.ENTRY_OUT_HEAD.unpack_from(ops.lookup(req))
    assert (nodeid, gen, entry_valid, attr_valid) == (0, 0, 60, 0)
    ops.shared = True
    try:
        ops.lookup(req)
        raise AssertionError("a shared namespace must answer ENOENT")
    except FsError as e:
        assert e.errno == errno.ENOENT
    assert not vfs.violations


def test_only_read_only_opens_skip_the_flush_at_close(tmp_path):
    """FOPEN_NOFLUSH on a read-only open (its FLUSH does nothing), never on a writer's,
    whose FLUSH is the close that journals the file."""
    vfs, ops, d, names = _dir_with(tmp_path, 1)
    ino = vfs.lookup(d, next(iter(names)), Ctx()).ino
    got = {}
    for unique, flags in enumerate((os.O_RDONLY, os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC)):
        reply = ops.open(Request(20 + unique, proto.OPEN, ino, 0, 0, 0,
                                 memoryview(proto.OPEN_IN.pack(flags, 0))))
        got[flags] = bool(proto.OPEN_OUT.unpack(reply.parts)[1] & proto.FOPEN_NOFLUSH)
    assert got == {os.O_RDONLY: True, os.O_WRONLY: False, os.O_RDWR: False,
                   os.O_RDONLY | os.O_TRUNC: False}


# --- the session: replies and INTERRUPT ----------------------------------------------------

class Wire:
    """A Session whose 'device' is a SOCK_SEQPACKET pair: every writev is one message."""

    def __init__(self, handlers):
        self.ours, self.kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.session = Session(self.ours.fileno(), handlers, threads=1, bufsize=1 << 16)

    def request(self, unique: int, opcode: int, body: bytes = b"", pid: int = 0) -> None:
        self.session._dispatch(Request(unique, opcode, 1, 0, 0, pid, memoryview(body)))

    def replies(self) -> list[tuple[int, int, bytes]]:
        out = []
        self.kernel.setblocking(False)
        while True:
            try:
                msg = self.kernel.recv(1 << 22)
            except BlockingIOError:
                return out
            length, error, unique = proto.OUT_HEADER.unpack_from(msg)
            assert length == len(msg)
            out.append((unique, error, msg[proto.OUT_HEADER.size:]))

    def close(self) -> None:
        self.ours.close()
        self.kernel.close()


def test_reply_of_more_buffers_than_iov_max_is_sent_whole():
    parts = [b"%04d" % i for i in range(3000)]
    w = Wire({proto.READDIR: lambda req: parts})
    try:
        w.request(7, proto.READDIR)
        assert w.replies() == [(7, 0, b"".join(parts))]
    finally:
        w.close()


def test_reply_that_cannot_be_written_is_answered_eio():
    big = bytes(300 << 10)        # above the socket's message size limit: EMSGSIZE
    w = Wire({proto.GETXATTR: lambda req: big})
    w.ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    try:
        w.request(9, proto.GETXATTR)
        assert w.replies() == [(9, -errno.EIO, b"")]
    finally:
        w.close()


def test_interrupt_of_a_running_request_lets_it_answer_normally():
    started, release = threading.Event(), threading.Event()

    def slow_getattr(req):
        started.set()
        release.wait(10)
        return b"attr"
    w = Wire({proto.GETATTR: slow_getattr})
    try:
        t = threading.Thread(target=w.request, args=(20, proto.GETATTR, b"", os.getpid()))
        t.start()
        assert started.wait(10)
        w.request(21, proto.INTERRUPT, proto.INTERRUPT_IN.pack(20))   # we are not dying
        assert w.replies() == []
        release.set()
        t.join(10)
        assert w.replies() == [(20, 0, b"attr")]
    finally:
        release.set()
        w.close()


def test_interrupt_before_its_request_is_answered_eagain():
    w = Wire({proto.GETATTR: lambda req: b"attr"})
    try:
        w.request(41, proto.INTERRUPT, proto.INTERRUPT_IN.pack(40))   # request 40 unseen
        assert w.replies() == []
        w.request(50, proto.GETATTR)               # the next request settles it
        assert w.replies() == [(41, -errno.EAGAIN, b""), (50, 0, b"attr")]
        # once its request is known, an early INTERRUPT is matched, not refused
        w.request(61, proto.INTERRUPT, proto.INTERRUPT_IN.pack(60))
        w.request(60, proto.GETATTR)
        assert w.replies() == [(60, 0, b"attr")]
        assert not w.session._early and not w.session._inflight
    finally:
        w.close()

