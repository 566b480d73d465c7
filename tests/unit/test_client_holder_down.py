"""A cluster node's reads of a file another node holds (acache.cluster.client.ClientVFS
._reader) when that holder does not answer: EIO, then EIO at once for a while without asking
it again -- unless it registered again since (a restart), or the under-storage holds that
very generation (the head's ``persisted``), which is then read instead.  One layer: a fake
peer and membership, a MemStore under-storage."""
from __future__ import annotations

import errno
import types

import pytest

from acache.cluster.client import ClientVFS
from acache.errors import FsError
from acache.data.under.mem import MemStore
from acache.net.transport import PeerUnavailable

DATA = b"0123456789" * 100


class Peer:
    """The holder: down (connection refused) or up (answers data.read from DATA)."""

    def __init__(self) -> None:
        self.up = False
        self.calls = 0
        self.lease = b"1"

    def __call__(self, node: str) -> "Peer":
        self.calls += 1
        if not self.up:
            raise PeerUnavailable(f"peer {node}: Connection refused")
        return self

    def read_into(self, op: str, args: dict, buf: memoryview) -> int:
        chunk = DATA[args["offset"]:args["offset"] + args["length"]]
        buf[:len(chunk)] = chunk
        return len(chunk)

    def incarnation(self, node: str) -> bytes | None:
        return self.lease if self.up else None


class Head:
    """The head's answer to ``source``: where the file's current generation is now."""

    def __init__(self) -> None:
        self.now: dict = {}

    def __call__(self, op: str, **args) -> dict:
        assert op == "source" and args == {"ino": 7}, (op, args)
        return self.now


def _vfs(peer: Peer, head: Head | None = None) -> tuple[ClientVFS, MemStore]:
    under = MemStore("mem://t")
    vfs = ClientVFS("n2", types.SimpleNamespace(attach=lambda evictor: None), under, head or Head(), peer,
                    incarnation=peer.incarnation)
    return vfs, under


def _src(**kw) -> dict:
    return {"gen": 3, "holder": "n1", "cached": True, "upath": None, "size": len(DATA), **kw}


def test_a_silent_holder_fails_at_once_until_it_restarts():
    peer = Peer()
    vfs, _ = _vfs(peer)
    read = vfs._reader(_src(), 7)
    with pytest.raises(FsError) as ei:
        read(0, 100)
    assert ei.value.errno == errno.EIO and peer.calls == 1
    with pytest.raises(FsError) as ei:     # the window: not asked again
        read(100, 100)
    assert ei.value.errno == errno.EIO and peer.calls == 1
    peer.up, peer.lease = True, b"2"       # registered again: a restart
    assert bytes(read(100, 100)) == DATA[100:200]
    assert peer.calls == 2


def test_the_same_incarnation_stays_shunned():
    peer = Peer()
    vfs, _ = _vfs(peer)
    read = vfs._reader(_src(), 7)
    peer.up = True                       # its lease is still there when the read fails
    real = peer.__call__
    peer_down = True

    def flaky(node):
        if peer_down:
            peer.calls += 1
            raise PeerUnavailable("timed out")
        return real(node)
    vfs.peer = flaky
    with pytest.raises(FsError):
        read(0, 100)
    peer_down = False
    with pytest.raises(FsError):         # same lease: a cut link, not a restart
        read(0, 100)
    assert peer.calls == 1


def test_a_dead_holders_persisted_generation_is_read_from_the_under_storage():
    peer, head = Peer(), Head()
    vfs, under = _vfs(peer, head)
    under.state.files["d/f"] = (DATA, 0.0)
    head.now = _src(upath="d/f", persisted=True)
    read = vfs._reader(head.now, 7)
    assert bytes(read(0, 100)) == DATA[:100]          # the holder refused: the under-storage
    assert bytes(read(500, 100)) == DATA[500:600]     # in the window too
    # since the open, another generation (or another file renamed over the path) went up
    # there: the head no longer says so, and the read fails instead of mixing files
    head.now = _src(upath="d/f", persisted=True, gen=4)
    with pytest.raises(FsError) as ei:
        read(600, 100)
    assert ei.value.errno == errno.EIO
    # an older generation at upath (a newer one not yet persisted) is never read there
    head.now = _src(upath="d/f", persisted=False)
    read = vfs._reader(head.now, 7)
    with pytest.raises(FsError) as ei:
        read(0, 100)
    assert ei.value.errno == errno.EIO
