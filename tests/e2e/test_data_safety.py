"""Data-safety probes (issue 9): barriers and states that must tell the truth, corrupted
or missing state that must stop or be reported, entries that can never succeed."""
from __future__ import annotations

import os

import pytest


@pytest.mark.e2e
def test_flush_and_status_of_dot_names_at_the_root(make_node):
    """`flush --wait /mnt/.metadata` waits for that file (not for 'metadata'), and
    `status /mnt/name.` shows that file."""
    n = make_node(flush_delay=3600)      # nothing lands unless a barrier asks for it
    (n.mnt / ".metadata").write_bytes(b"m" * 100)
    (n.mnt / "tail.").write_bytes(b"t" * 10)
    st = n.status(str(n.mnt / ".metadata"))
    assert [(f["path"], f["state"]) for f in st["files"]] == [(".metadata", "dirty")]
    st = n.status(str(n.mnt / "tail."))
    assert [f["path"] for f in st["files"]] == ["tail."]
    n.flush(str(n.mnt / ".metadata"), timeout=60)
    assert (n.ufs_dir / ".metadata").read_bytes() == b"m" * 100
    n.flush(str(n.mnt / "tail."), timeout=60)
    assert (n.ufs_dir / "tail.").read_bytes() == b"t" * 10
