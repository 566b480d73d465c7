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


def _lost_found(n) -> dict[str, bytes]:
    d = n.home / "cache" / "lost+found"
    return {p.name: p.read_bytes() for p in d.iterdir()} if d.is_dir() else {}


def _wal(n):
    logs = sorted((n.home / "cache" / "meta").glob("*.log"))
    assert logs, "no RocksDB WAL found"
    return logs


@pytest.mark.e2e
def test_deleted_wal_keeps_closed_files_in_lost_found(make_node):
    """kill -9, the RocksDB WAL deleted: the metadata forgets 3 closed, unpersisted files;
    their cache files are moved to lost+found and reported, never deleted."""
    n = make_node(flush_delay=3600)
    data = {f"f{i}": os.urandom(1000 * (i + 1)) for i in range(3)}
    for name, b in data.items():
        (n.mnt / name).write_bytes(b)
    n.kill9()
    for wal in _wal(n):
        wal.unlink()
    n.restart()
    st = n.status()
    assert st["lost_found_files"] == 3 and st["lost_found_bytes"] == sum(map(len, data.values()))
    assert sorted(_lost_found(n).values()) == sorted(data.values())
    assert "not known to the metadata" in (n.home / "acache.log").read_text()
    p = n.cli("flush", "--wait", "--timeout", "60")
    assert "lost+found" in p.stderr
    assert "lost+found" in n.cli("status").stdout


@pytest.mark.e2e
def test_damaged_wal_refuses_to_start_then_salvage_reports(make_node):
    """A truncated WAL: the node refuses to start with one line naming the damage and the
    way out; started with ACACHE_META_SALVAGE=1, every closed file is either persisted or
    kept in lost+found (nothing dropped silently)."""
    n = make_node(flush_delay=3600)
    data = {f"f{i}": os.urandom(1000 * (i + 1)) for i in range(3)}
    for name, b in data.items():
        (n.mnt / name).write_bytes(b)
    n.kill9()
    wal = _wal(n)[-1]
    os.truncate(wal, wal.stat().st_size - 5)     # inside the last record: a torn tail
    p = n.cli("up", check=False)
    assert p.returncode != 0
    line = p.stderr.strip().splitlines()[-1]
    assert "damaged" in line and "ACACHE_META_SALVAGE=1" in line, p.stderr
    assert n.pid() is None
    n.env["ACACHE_META_SALVAGE"] = "1"
    n.restart()
    del n.env["ACACHE_META_SALVAGE"]
    n.flush(timeout=60)
    kept = set(n.ufs_files().values()) | set(_lost_found(n).values())
    for name, b in data.items():
        assert b in kept, f"{name}: neither persisted nor in lost+found"


@pytest.mark.e2e
def test_missing_cache_file_of_fsynced_open_file_is_never_uploaded_empty(make_node):
    """A persisted file rewritten (O_TRUNC) and fsynced, still open at kill -9; its cache
    file then deleted: the good copy in the under-storage stays, the file is 'failed' with
    the reason, and the barrier says so."""
    n = make_node(flush_delay=0.2)
    old, new = os.urandom(5000), os.urandom(7000)
    (n.mnt / "a").write_bytes(old)
    n.flush(timeout=60)
    fd = os.open(n.mnt / "a", os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, new)
        os.fsync(fd)
        n.kill9()
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    hits = [p for p in (n.home / "cache" / "data").iterdir() if p.read_bytes() == new]
    assert len(hits) == 1
    hits[0].unlink()
    n.restart()
    p = n.cli("flush", "--wait", "--timeout", "20", check=False)
    assert p.returncode != 0 and "cache file missing" in p.stderr, p.stderr
    assert (n.ufs_dir / "a").read_bytes() == old
    st = n.status(str(n.mnt / "a"))
    assert [f["state"] for f in st["files"]] == ["failed"]
    assert "cache file missing" in st["last_error"]
