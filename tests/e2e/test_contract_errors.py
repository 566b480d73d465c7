"""Contract, points 6 and 7: a permanent under-storage error is reported (file state
`failed`, `status`, `flush --wait` exits non-zero with the reason), the data is kept,
and it lands once the cause is fixed."""
from __future__ import annotations

import os

from tests.e2e.contract_util import one_line_error, ufs_real


def test_permanent_error_reported_and_data_kept(make_node):
    n = make_node(flush_delay=0)
    (n.mnt / "ok").write_bytes(b"ok")
    n.flush()
    # someone put a *file* where acache needs a directory, behind its back
    (n.ufs_dir / "ckpt").write_bytes(b"in the way")
    (n.mnt / "ckpt").mkdir()
    (n.mnt / "ckpt" / "shard").write_bytes(b"precious")
    p = n.cli("flush", "--wait", "--timeout", "20", check=False)
    one_line_error(p)
    assert "ckpt" in p.stderr, p.stderr
    st = n.status(str(n.mnt))
    assert st["last_error"] and st["failed"] >= 1, st
    states = {f["path"]: f["state"] for f in st["files"]}
    assert states["ok"] == "persisted"
    assert states["ckpt/shard"] in ("dirty", "failed"), states
    assert (n.mnt / "ckpt" / "shard").read_bytes() == b"precious"
    os.unlink(n.ufs_dir / "ckpt")         # the operator fixes it
    n.flush()                             # retried at once when asked
    assert ufs_real(n.ufs_files()) == {"ok": b"ok", "ckpt/shard": b"precious"}
    assert os.getxattr(n.mnt / "ckpt" / "shard", "user.acache.state") == b"persisted"
    assert not n.status()["last_error"]
