"""Data-safety probes (issue 9): barriers and states that must tell the truth, corrupted
or missing state that must stop or be reported, entries that can never succeed."""
from __future__ import annotations

import os

import pytest

from tests.acache_node import AcacheNode, fuse_mounts


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
    # they hold names of private directories
    assert (n.home / "cache" / "meta").stat().st_mode & 0o777 == 0o700
    assert (n.home / "acache.log").stat().st_mode & 0o777 == 0o600
    assert (n.home / "cache" / "lost+found").stat().st_mode & 0o777 == 0o700


def _all_kept_or_reported(n, data: dict) -> None:
    """Every closed file is persisted, shown 'unacknowledged' on the mount, or kept in
    lost+found -- and a file not persisted is never dropped without a report."""
    n.flush(timeout=60)
    st = n.status(str(n.mnt))
    unacked = {f["path"] for f in st["files"] if f["state"] == "unacknowledged"}
    persisted = set(n.ufs_files().values())
    found = set(_lost_found(n).values())
    kept = persisted | found | {(n.mnt / p).read_bytes() for p in unacked}
    for name, b in data.items():
        assert b in kept, f"{name}: neither persisted, in lost+found nor shown unacknowledged"
    assert st["lost_found_files"] == len(_lost_found(n)), st   # reported, not only kept


def _closed_files_then_kill9(make_node):
    """A node (nothing persists on its own), three closed files, then kill -9."""
    n = make_node(flush_delay=3600)
    data = {f"f{i}": os.urandom(1000 * (i + 1)) for i in range(3)}
    for name, b in data.items():
        (n.mnt / name).write_bytes(b)
    n.kill9()
    return n, data


@pytest.mark.e2e
def test_torn_wal_tail_starts_and_reports(make_node):
    """A WAL whose last record is torn (a write that never completed, as a host crash
    leaves it): the node starts; every closed file is persisted, unacknowledged or in
    lost+found (reported), nothing dropped silently."""
    n, data = _closed_files_then_kill9(make_node)
    wal = _wal(n)[-1]
    os.truncate(wal, wal.stat().st_size - 5)     # inside the last record: a torn tail
    n.restart()
    _all_kept_or_reported(n, data)


@pytest.mark.e2e
def test_damaged_wal_refuses_to_start_then_salvage_reports(make_node):
    """A WAL damaged before its end (a checksum mismatch in a middle record): the node
    refuses to start with one line naming the damage and the way out; started with
    ACACHE_META_SALVAGE=1, every closed file is persisted, unacknowledged or in lost+found."""
    n, data = _closed_files_then_kill9(make_node)
    wal = _wal(n)[-1]
    size = wal.stat().st_size
    with open(wal, "r+b") as f:                  # flip one byte a third of the way in
        f.seek(size // 3)
        b = f.read(1)
        f.seek(size // 3)
        f.write(bytes([b[0] ^ 0xFF]))
    p = n.cli("up", check=False)
    assert p.returncode != 0
    line = p.stderr.strip().splitlines()[-1]
    assert "damaged" in line and "ACACHE_META_SALVAGE=1" in line, p.stderr
    assert n.pid() is None
    n.env["ACACHE_META_SALVAGE"] = "1"
    n.restart()
    del n.env["ACACHE_META_SALVAGE"]
    _all_kept_or_reported(n, data)


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


@pytest.fixture(params=["pyfuse3", "native", "native-nopt"])
def crash_node(request, tmp_path):
    """A node on each engine, and the native one with and without kernel passthrough."""
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.fail("e2e tests need /dev/fuse and root")
    env = {"ACACHE_PASSTHROUGH": "0"} if request.param == "native-nopt" else {}
    n = AcacheNode(tmp_path, engine=request.param.split("-")[0], flush_delay=3600,
                   extra_env=env).start()
    yield n
    n.stop()
    assert str(n.mnt) not in fuse_mounts(), f"{n.mnt} is still mounted after the test"


@pytest.mark.e2e
def test_unclosed_unsynced_file_is_not_published_after_a_crash(crash_node):
    """kill -9 while files are open for writing: one never fsynced is not published (kept
    locally, 'unacknowledged'); a rewrite of a persisted file keeps the persisted copy in
    the under-storage; one fsynced halfway lands with at least the fsynced bytes."""
    n = crash_node
    old = os.urandom(300_000)
    (n.mnt / "persisted").write_bytes(old)
    n.flush(timeout=60)
    part, synced = os.urandom(3 << 20), os.urandom(2 << 20)
    fds = []
    try:
        fd = os.open(n.mnt / "unclosed", os.O_CREAT | os.O_WRONLY, 0o644)
        fds.append(fd)
        os.write(fd, part)
        fd = os.open(n.mnt / "persisted", os.O_WRONLY | os.O_TRUNC)
        fds.append(fd)
        os.write(fd, part[:100_000])
        fd = os.open(n.mnt / "synced", os.O_CREAT | os.O_WRONLY, 0o644)
        fds.append(fd)
        os.write(fd, synced[:1 << 20])
        os.fsync(fd)
        os.write(fd, synced[1 << 20:])
        n.kill9()
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
    n.restart()
    n.flush(timeout=60)
    ufs = n.ufs_files()
    assert "unclosed" not in ufs, f"an unacknowledged file was published ({len(ufs['unclosed'])} bytes)"
    assert ufs["persisted"] == old
    assert len(ufs["synced"]) >= 1 << 20 and synced.startswith(ufs["synced"])
    st = {f["path"]: f for f in n.status(str(n.mnt))["files"]}
    assert st["unclosed"]["state"] == "unacknowledged" and "crash" in st["unclosed"]["note"]
    assert st["persisted"]["state"] == "unacknowledged"
    assert st["synced"]["state"] == "persisted"
    # kept as a local disk would keep it: the mount shows what reached the cache
    assert part.startswith((n.mnt / "unclosed").read_bytes())
    # closing it again acknowledges it: then it is persisted
    with open(n.mnt / "unclosed", "ab"):
        pass
    n.flush(timeout=60)
    assert n.ufs_files()["unclosed"] == (n.mnt / "unclosed").read_bytes()


@pytest.mark.e2e
def test_rename_whose_source_another_tool_removed_does_not_wedge(make_node):
    """run1 is persisted and renamed to run1-old on the mount; before the rename lands,
    another tool removes run1 from the under-storage: the rename is applied by writing
    run1-old from the cache, and later files land after it."""
    import shutil
    n = make_node(flush_delay=3600)
    (n.mnt / "run1" / "sub").mkdir(parents=True)
    data = {"run1/a": os.urandom(5000), "run1/sub/b": os.urandom(70_000)}
    for p, b in data.items():
        (n.mnt / p).write_bytes(b)
    n.flush(timeout=60)
    os.rename(n.mnt / "run1", n.mnt / "run1-old")
    shutil.rmtree(n.ufs_dir / "run1")
    (n.mnt / "after").write_bytes(b"later")
    n.flush(timeout=60)
    ufs = n.ufs_files()
    assert ufs == {"run1-old/a": data["run1/a"], "run1-old/sub/b": data["run1/sub/b"],
                   "after": b"later"}
    assert n.status()["failed"] == 0
    assert "source was gone" in (n.home / "acache.log").read_text()


@pytest.mark.e2e
def test_journal_lists_and_skips_an_entry_that_can_never_succeed(make_node):
    """A pending file whose cache file was removed: `acache journal` shows its PUT failed
    with the reason, `acache journal skip SEQ --reason` drops it; later files land."""
    n = make_node(flush_delay=3600)
    (n.mnt / "lost").write_bytes(os.urandom(4000))
    (n.mnt / "after").write_bytes(b"later")
    for p in (n.home / "cache" / "data").iterdir():
        if p.stat().st_size == 4000:
            p.unlink()
    p = n.cli("flush", "--wait", "--timeout", "20", check=False)
    assert p.returncode != 0 and "cache file missing" in p.stderr
    import json
    res = json.loads(n.cli("journal", "--json").stdout)
    assert [(e["op"], e["path"], e["state"]) for e in res["entries"]][:1] == \
        [("put", "lost", "failed")]
    assert [(e["path"], e["state"] in ("staging", "staged")) for e in res["entries"][1:]] == \
        [("after", True)]     # uploaded in parallel, committed only after "lost"
    assert "cache file missing" in res["entries"][0]["error"]
    assert "lost" in n.cli("journal").stdout
    st = n.status()
    assert [(f["op"], f["path"]) for f in st["failed_entries"]] == [("put", "lost")]
    assert "cache file missing" in n.cli("status").stdout
    p = n.cli("journal", "skip", str(res["entries"][0]["seq"]), check=False)
    assert p.returncode != 0     # --reason is required
    n.cli("journal", "skip", str(res["entries"][0]["seq"]), "--reason", "deleted by hand")
    n.flush(timeout=60)
    assert n.ufs_files() == {"after": b"later"}
    assert "skipped by the operator: deleted by hand" in (n.home / "acache.log").read_text()
    st = {f["path"]: f for f in n.status(str(n.mnt))["files"]}
    assert st["lost"]["state"] == "unacknowledged" and "skipped" in st["lost"]["note"]
