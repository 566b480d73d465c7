"""The head asks a file's holder to stage it (S3 parts, or the temp file on a shared
directory) only if the holder serves that request: a node of an older acache (a rolling
upgrade) lists no such op in its handshake, and would drop the connection at the request
(an unknown op), so that every retry failed the same way and the journal stood still.  Its
files are copied to the head instead (``pull``).  One layer: a real TCP listener on
loopback (its handshake is what tells the ops), a fake under-storage and member."""
from __future__ import annotations

import types

import pytest

from acache.cluster.member import _Head
from acache.net.tcp import TcpTransport
from acache.net.transport import Reply


class Under:
    """Records what the head asked of it; S3-like (parts) or a shared directory."""

    def __init__(self, shared_dir: bool) -> None:
        self.calls: list[str] = []
        if shared_dir:
            self.staged_from = lambda token, path, made: ("staged", made)

    def parts_elsewhere(self, size: int) -> bool:
        return True

    def stage_parts(self, path, token, size, send_part, progress, attrs=None, on_token=None):
        self.calls.append("stage_parts")
        return ("staged", send_part("upload-1", 1, 0, size))


@pytest.fixture
def holder():
    """A holder listening on loopback that serves the ops given to it (``serve(...)``)."""
    made = []

    def serve(*ops: str):
        lst = TcpTransport(None).listen("127.0.0.1:0")
        for op in ("data.read", *ops):
            lst.register(op, lambda meta, p, op=op: Reply({"etag": "e1", "ino": 7, "op": op}))
        lst.start()
        made.append(lst)
        return lst
    yield serve
    for lst in made:
        lst.close()


def head_with(under: Under, address: str) -> tuple[_Head, list]:
    conns: list = []
    t = TcpTransport(None)

    def conn(node: str):
        if not conns:
            conns.append(t.connect(address))
        return conns[0]
    member = types.SimpleNamespace(node_id="a", under=under, conn=conn, _drop_conn=lambda n: None)
    h = object.__new__(_Head)
    h.member, h._no_parts = member, set()
    return h, conns


def entry(size: int = 1 << 20):
    return types.SimpleNamespace(ino=7, gen=1, path="ckpt/shard", token="tok", size=size,
                                 attrs=[], node="b")


@pytest.mark.parametrize("shared_dir", [False, True], ids=["s3-parts", "shared-dir"])
def test_an_older_holder_is_not_asked_to_stage(holder, shared_dir):
    lst = holder()                                   # serves data.read only (an older node)
    under = Under(shared_dir)
    h, conns = head_with(under, lst.address)
    try:
        assert h.stage_elsewhere(entry(), lambda n: None, lambda t: None) is None
        assert under.calls == []                     # no stage begun: the head pulls the file
        assert "b" in h._no_parts
        # the connection is still there: nothing was sent that the holder drops it for
        assert conns[0].request("data.read", {}) == ({"etag": "e1", "ino": 7, "op": "data.read"}, b"")
    finally:
        for c in conns:
            c.close()


@pytest.mark.parametrize("shared_dir", [False, True], ids=["s3-parts", "shared-dir"])
def test_a_holder_that_serves_staging_is_asked(holder, shared_dir):
    lst = holder("data.stage_part", "data.stage_file")
    under = Under(shared_dir)
    h, conns = head_with(under, lst.address)
    try:
        staged = h.stage_elsewhere(entry(), lambda n: None, lambda t: None)
        if shared_dir:
            assert staged == ("staged", {"etag": "e1", "ino": 7, "op": "data.stage_file"})
        else:
            assert staged == ("staged", "e1") and under.calls == ["stage_parts"]
        assert not h._no_parts
    finally:
        for c in conns:
            c.close()
