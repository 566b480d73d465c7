"""Symbolic links, persisted attributes and a hostile file:// under-storage, through real
mounts on every engine (pyfuse3; native with and without kernel passthrough).

A cold cache is a new node (new ACACHE_HOME: no metadata, no cache files) on the same
under-storage: what it shows comes from the under-storage alone."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.acache_node import AcacheNode, fuse_mounts

VARIANTS = {"pyfuse3": ("pyfuse3", {}), "native": ("native", {}),
            "native-nopt": ("native", {"ACACHE_PASSTHROUGH": "0"})}
NOBODY = 65534
MTIME = 1_700_000_000_123_456_789


@pytest.fixture
def world():
    """A directory every user can traverse (pytest's tmp_path is 0700 root): the
    non-root checks need to reach the mount."""
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.fail("e2e tests need /dev/fuse and root")
    d = Path(f"/tmp/acache-links-{uuid.uuid4().hex[:10]}")
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=list(VARIANTS))
def make(request, world):
    engine, env = VARIANTS[request.param]
    nodes: list[AcacheNode] = []

    def make(ufs: Path, name: str | None = None, start: bool = True) -> AcacheNode:
        n = AcacheNode(world / (name or f"n{len(nodes)}"), engine=engine,
                       ufs=f"file://{ufs}", extra_env=env)
        os.chmod(n.root, 0o755)
        os.chmod(n.mnt, 0o755)
        nodes.append(n)
        return n.start() if start else n
    yield make
    for n in nodes:
        n.stop()
    left = [m for m in fuse_mounts() if m.startswith(str(world))]
    assert not left, f"mounts left behind: {left}"


def as_nobody(*cmd: str) -> subprocess.CompletedProcess:
    def drop():
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    return subprocess.run(list(cmd), preexec_fn=drop, capture_output=True, text=True, timeout=60)


def test_links_persist_and_list_back_as_links(make, world):
    ufs = world / "ufs"
    n = make(ufs)
    m = n.mnt
    (m / "checkpoint-3").mkdir()
    (m / "checkpoint-3" / "w.bin").write_bytes(b"weights")
    os.symlink("checkpoint-3", m / "latest")                       # the `latest` pattern
    subprocess.run(["ln", "-s", "../shared/tokenizer.json", str(m / "checkpoint-3" / "tok")],
                   check=True)
    assert subprocess.run(["readlink", str(m / "latest")], capture_output=True, text=True,
                          check=True).stdout.strip() == "checkpoint-3"
    st = os.lstat(m / "latest")
    assert stat.S_ISLNK(st.st_mode) and st.st_size == len("checkpoint-3")
    assert (m / "latest" / "w.bin").read_bytes() == b"weights"     # the kernel follows it
    os.symlink("checkpoint-2", m / "tmp-link")                     # renamed, then deleted:
    os.rename(m / "tmp-link", m / "old-link")                      # never persisted
    os.unlink(m / "old-link")
    os.symlink("checkpoint-1", m / "renamed-before")
    os.rename(m / "renamed-before", m / "previous")
    os.chown(m / "latest", 1234, 5678, follow_symlinks=False)
    os.utime(m / "latest", ns=(MTIME, MTIME), follow_symlinks=False)
    n.flush(timeout=60)
    assert os.readlink(ufs / "latest") == "checkpoint-3"
    assert os.readlink(ufs / "checkpoint-3" / "tok") == "../shared/tokenizer.json"
    assert os.readlink(ufs / "previous") == "checkpoint-1"
    assert not any(os.path.lexists(ufs / x) for x in ("tmp-link", "old-link", "renamed-before"))
    assert not [p for p in ufs.rglob(".acache-tmp.*")]
    u = os.lstat(ufs / "latest")
    assert (u.st_uid, u.st_gid, u.st_mtime_ns) == (1234, 5678, MTIME)
    n.stop()

    cold = make(ufs)
    c = cold.mnt
    assert sorted(os.listdir(c)) == ["checkpoint-3", "latest", "previous"]
    st = os.lstat(c / "latest")
    assert stat.S_ISLNK(st.st_mode) and os.readlink(c / "latest") == "checkpoint-3"
    assert (st.st_uid, st.st_gid, st.st_mtime_ns) == (1234, 5678, MTIME)
    assert os.readlink(c / "checkpoint-3" / "tok") == "../shared/tokenizer.json"
    assert (c / "latest" / "w.bin").read_bytes() == b"weights"


def test_attributes_persist_and_come_back_on_a_cold_cache(make, world):
    ufs = world / "ufs"
    n = make(ufs)
    m = n.mnt
    (m / "run").mkdir(mode=0o700)
    os.chmod(m / "run", 0o700)
    os.chown(m / "run", 1000, 1000)
    with open(m / "run" / "private.pt", "wb") as f:
        f.write(b"p" * 1000)
    os.chmod(m / "run" / "private.pt", 0o600)                     # before it lands: collapses
    os.chown(m / "run" / "private.pt", 1000, 1001)
    os.utime(m / "run" / "private.pt", ns=(MTIME, MTIME))
    (m / "run" / "later.pt").write_bytes(b"l")
    n.flush(timeout=60)
    u = os.stat(ufs / "run" / "private.pt")
    assert (stat.S_IMODE(u.st_mode), u.st_uid, u.st_gid, u.st_mtime_ns) == (0o600, 1000, 1001, MTIME)
    d = os.stat(ufs / "run")
    assert (stat.S_IMODE(d.st_mode), d.st_uid) == (0o700, 1000)
    # only attributes of a persisted file change: no re-upload (same inode in the store)
    ino = os.stat(ufs / "run" / "later.pt").st_ino
    os.chmod(m / "run" / "later.pt", 0o640)
    os.utime(m / "run" / "later.pt", ns=(MTIME + 5, MTIME + 5))
    n.flush(timeout=60)
    u = os.stat(ufs / "run" / "later.pt")
    assert (u.st_ino, stat.S_IMODE(u.st_mode), u.st_mtime_ns) == (ino, 0o640, MTIME + 5)
    n.stop()

    cold = make(ufs)
    c = cold.mnt
    s = os.stat(c / "run" / "private.pt")
    assert (stat.S_IMODE(s.st_mode), s.st_uid, s.st_gid, s.st_mtime_ns) == (0o600, 1000, 1001, MTIME)
    s = os.stat(c / "run")
    assert (stat.S_IMODE(s.st_mode), s.st_uid) == (0o700, 1000)
    assert as_nobody("cat", str(c / "run" / "private.pt")).returncode != 0   # stays private
    s = os.stat(c / "run" / "later.pt")
    assert (stat.S_IMODE(s.st_mode), s.st_mtime_ns) == (0o640, MTIME + 5)


def test_planted_links_in_the_under_storage_leak_nothing(make, world):
    outside = world / "outside"
    (outside / "private").mkdir(parents=True)
    os.chmod(outside / "private", 0o700)
    (outside / "private" / "secret").write_bytes(b"secret")
    os.chmod(outside / "private" / "secret", 0o600)
    (outside / "rootonly").mkdir()
    os.chmod(outside / "rootonly", 0o700)
    ufs = world / "ufs"
    ufs.mkdir()
    os.symlink(outside / "private" / "secret", ufs / "secret")
    os.symlink(outside / "rootonly", ufs / "dl")
    n = make(ufs)
    m = n.mnt
    os.chown(m, NOBODY, NOBODY)   # the user owns the mount's root (what listing inherits)
    r = as_nobody("cat", str(m / "secret"))
    assert r.returncode != 0 and "secret" not in r.stdout, r
    r = as_nobody("sh", "-c", f"echo pwned > {m / 'dl' / 'x'}")
    assert r.returncode != 0, r
    assert stat.S_ISLNK(os.lstat(m / "secret").st_mode) and stat.S_ISLNK(os.lstat(m / "dl").st_mode)
    assert os.readlink(m / "dl") == str(outside / "rootonly")
    n.flush(timeout=60)
    assert os.listdir(outside / "rootonly") == []
    assert (outside / "private" / "secret").read_bytes() == b"secret"


# -- s3:// ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def srv():
    from tests.s3server import S3Server
    with S3Server() as s:
        yield s


@pytest.fixture(params=list(VARIANTS))
def make_s3(request, world, srv):
    engine, env = VARIANTS[request.param]
    nodes: list[AcacheNode] = []

    def make(prefix: str) -> AcacheNode:
        s3env = {f"ACACHE_S3_{k.upper()}": str(v) for k, v in srv.options().items()}
        n = AcacheNode(world / f"n{len(nodes)}", engine=engine, ufs=srv.url(prefix),
                       extra_env={**env, **s3env})
        nodes.append(n)
        return n.start()
    yield make
    for n in nodes:
        n.stop()
    left = [m for m in fuse_mounts() if m.startswith(str(world))]
    assert not left, f"mounts left behind: {left}"


def test_s3_links_and_attributes_persist_and_come_back(make_s3, srv):
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    n = make_s3(prefix)
    m = n.mnt
    (m / "checkpoint-3").mkdir()
    os.chmod(m / "checkpoint-3", 0o750)
    blob = os.urandom(2 << 20)
    (m / "checkpoint-3" / "w.bin").write_bytes(blob)
    os.chmod(m / "checkpoint-3" / "w.bin", 0o600)
    os.chown(m / "checkpoint-3" / "w.bin", 1000, 1001)
    os.utime(m / "checkpoint-3" / "w.bin", ns=(MTIME, MTIME))
    os.symlink("checkpoint-3", m / "tmp-latest")
    os.rename(m / "tmp-latest", m / "latest")                     # never persisted under tmp-
    os.symlink("gone", m / "gone")
    os.unlink(m / "gone")
    n.flush(timeout=60)
    c = srv.client()
    keys = {o.object_name[len(prefix) + 1:] for o in
            c.list_objects(srv.bucket, prefix=prefix + "/", recursive=True)}
    assert keys == {"checkpoint-3/", "checkpoint-3/w.bin", "latest.rclonelink"}, keys
    r = c.get_object(srv.bucket, f"{prefix}/latest.rclonelink")
    assert r.read() == b"checkpoint-3"
    r.close()
    r.release_conn()
    meta = c.stat_object(srv.bucket, f"{prefix}/checkpoint-3/w.bin").metadata
    assert (meta["x-amz-meta-mode"], meta["x-amz-meta-uid"], meta["x-amz-meta-gid"]) == \
        (str(0o100600), "1000", "1001")
    assert meta["x-amz-meta-mtime"] == "1700000000.123456789"
    # only attributes change: a copy in place, not a re-upload of the 2 MiB
    done, up = n.status()["persisted_files"], srv.bytes_up
    os.chmod(m / "checkpoint-3" / "w.bin", 0o640)
    n.flush(timeout=60)
    assert n.status()["persisted_files"] == done and srv.bytes_up - up < 64 << 10
    meta = c.stat_object(srv.bucket, f"{prefix}/checkpoint-3/w.bin").metadata
    assert meta["x-amz-meta-mode"] == str(0o100640) and meta["x-amz-meta-uid"] == "1000"
    n.stop()

    cold = make_s3(prefix)
    cm = cold.mnt
    assert sorted(os.listdir(cm)) == ["checkpoint-3", "latest"]
    assert stat.S_ISLNK(os.lstat(cm / "latest").st_mode)
    assert os.readlink(cm / "latest") == "checkpoint-3"
    s = os.stat(cm / "latest" / "w.bin")
    assert (stat.S_IMODE(s.st_mode), s.st_uid, s.st_gid, s.st_mtime_ns) == (0o640, 1000, 1001, MTIME)
    assert stat.S_IMODE(os.stat(cm / "checkpoint-3").st_mode) == 0o750
    assert (cm / "latest" / "w.bin").read_bytes() == blob


def test_s3_hostile_keys_are_skipped_in_the_mount(make_s3, srv):
    """Keys another tool wrote with '..', '.' or empty segments (which no SDK would write)
    list as nothing, never as a path outside the prefix; the rest lists normally."""
    import urllib3
    from urllib.parse import quote
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    http = urllib3.PoolManager()
    for key in ("ok/../../escape", "ok/./dot", "ok//empty", "ok/" + "n" * 300, "ok/fine",
                "../up.rclonelink"):
        enc = "/".join("%2E" * len(p) if p in (".", "..") else quote(p)
                       for p in f"{prefix}/{key}".split("/"))
        assert http.request("PUT", f"{srv.endpoint}/{srv.bucket}/{enc}", body=b"x").status == 200
    n = make_s3(prefix)
    assert sorted(os.listdir(n.mnt)) == ["ok"]
    assert os.listdir(n.mnt / "ok") == ["fine"]
    assert (n.mnt / "ok" / "fine").read_bytes() == b"x"
    assert "skipping" in (n.home / "acache.log").read_text()
