"""The native engine on a real mount (root, /dev/fuse), driven by ordinary programs.

Each test mounts a MemVFS (metadata in memory, data in a real backing directory) in a tmp
dir and always unmounts in teardown.  Opcode counts show what reached the daemon.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import mmap
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from acache.fs.native import NativeEngine, clean_stale_mount, probe_passthrough
from acache.fs.native import mount as native_mount
from acache.fs.native import passthrough as pt
from acache.fs.native import proto

try:
    from .test_native_memvfs import MemVFS
except ImportError:
    from test_native_memvfs import MemVFS

try:
    from .native_fixtures import NATIVE_MARKS, tmp_path  # noqa: F401 (a fixture)
except ImportError:
    from native_fixtures import NATIVE_MARKS, tmp_path  # noqa: F401

pytestmark = NATIVE_MARKS

_libc = ctypes.CDLL(None, use_errno=True)
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
AT_FDCWD = -100


def renameat2(old: str, new: str, flags: int) -> None:
    if _libc.renameat2(AT_FDCWD, old.encode(), AT_FDCWD, new.encode(), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class Mounted:
    def __init__(self, tmp_path, **kw):
        self.root = str(tmp_path)
        self.mnt = os.path.join(self.root, "mnt")
        os.makedirs(self.mnt, exist_ok=True)
        vfs_kw = {k: kw.pop(k) for k in ("cow_on_write",) if k in kw}
        self.vfs = MemVFS(os.path.join(self.root, "cache"),
                          passthrough=kw.get("passthrough", True), **vfs_kw)
        kw.setdefault("passthrough", True)
        kw.setdefault("threads", 4)
        self.eng = NativeEngine(self.vfs, self.mnt, **kw)
        self.eng.start()

    def p(self, *names: str) -> str:
        return os.path.join(self.mnt, *names)

    def counts(self) -> dict[str, int]:
        return self.eng.op_counts()

    def close(self) -> None:
        self.eng.stop()
        assert not os.path.ismount(self.mnt)
        assert not self.vfs.violations, self.vfs.violations


@pytest.fixture
def mounted(tmp_path):
    made = []

    def make(**kw) -> Mounted:
        m = Mounted(tmp_path / f"m{len(made)}", **kw)
        made.append(m)
        return m
    yield make
    for m in made:
        m.close()


def _sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --- passthrough ---------------------------------------------------------------------------

def test_probe_passthrough_here(tmp_path):
    ok, why = probe_passthrough(str(tmp_path))
    assert ok, why
    assert "passthrough available" in why


def test_passthrough_write_read_no_data_requests(mounted):
    m = mounted()
    assert m.eng.passthrough_active
    data = os.urandom(3 << 20) + b"tail"
    with open(m.p("ckpt.bin"), "wb") as f:
        f.write(data)
        f.flush()
        assert os.fstat(f.fileno()).st_size == len(data)
    assert os.stat(m.p("ckpt.bin")).st_size == len(data)
    with open(m.p("ckpt.bin"), "rb") as f:
        assert f.read() == data
    with open(m.p("ckpt.bin"), "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert mm[-4:] == b"tail" and mm[:100] == data[:100]
    ino = os.stat(m.p("ckpt.bin")).st_ino
    with open(m.vfs.path(ino), "rb") as f:          # the bytes are in the cache file
        assert f.read() == data
    c = m.counts()
    assert c.get("WRITE", 0) == 0 and c.get("READ", 0) == 0, c
    assert c["CREATE"] == 1 and c["FLUSH"] >= 1


def test_shell_tools(mounted):
    m = mounted()
    src = os.path.join(m.root, "src.bin")
    with open(src, "wb") as f:
        f.write(os.urandom(5 << 20))
    subprocess.run(["dd", f"if={src}", f"of={m.p('dd.bin')}", "bs=1M", "conv=fsync"],
                   check=True, capture_output=True)
    subprocess.run(["cp", m.p("dd.bin"), m.p("cp.bin")], check=True)
    subprocess.run(["sh", "-c", 'cat "$1" > "$2"', "sh", m.p("cp.bin"), m.p("cat.bin")], check=True)
    for name in ("dd.bin", "cp.bin", "cat.bin"):
        assert _sha(m.p(name)) == _sha(src)
    subprocess.run(["cmp", src, m.p("cat.bin")], check=True)
    out = subprocess.run(["ls", "-l", m.mnt], check=True, capture_output=True, text=True).stdout
    assert "dd.bin" in out and str(5 << 20) in out
    assert m.vfs.calls["fsync"] >= 1            # conv=fsync reached the VFS
    assert m.counts().get("WRITE", 0) == 0


def test_python_file_ops(mounted):
    m = mounted()
    p = m.p("f")
    with open(p, "wb") as f:
        f.write(b"a" * 100)
    with open(p, "ab") as f:                        # append
        f.write(b"b" * 10)
    with open(p, "r+b") as f:                       # random write
        f.seek(50)
        f.write(b"XY")
        f.truncate(105)                             # ftruncate through the handle
    assert os.stat(p).st_size == 105
    with open(p, "rb") as f:
        got = f.read()
    assert got == b"a" * 50 + b"XY" + b"a" * 48 + b"b" * 5
    os.truncate(p, 10)                              # truncate by path
    assert os.stat(p).st_size == 10
    with open(p, "wb") as f:                        # O_TRUNC overwrite
        f.write(b"new")
    with open(p, "rb") as f:
        assert f.read() == b"new"
    os.chmod(p, 0o600)
    os.utime(p, ns=(1_000_000_000, 2_000_000_123))
    st = os.stat(p)
    assert st.st_mode & 0o777 == 0o600 and st.st_mtime_ns == 2_000_000_123
    os.mkdir(m.p("d"))
    os.rename(p, m.p("d", "g"))
    assert os.listdir(m.p("d")) == ["g"]
    with open(m.p("d", "g"), "rb") as f:
        os.unlink(m.p("d", "g"))                    # unlink while open
        assert f.read() == b"new"
    os.rmdir(m.p("d"))
    assert os.listdir(m.mnt) == []
    os.mknod(m.p("node"), 0o644 | 0o100000)
    assert os.stat(m.p("node")).st_size == 0
    with pytest.raises(OSError) as e:
        os.symlink("x", m.p("link"))
    assert e.value.errno == errno.EPERM


def test_stat_while_writing_sees_the_growing_size(mounted):
    m = mounted()
    with open(m.p("grow"), "wb") as f:
        for i in range(1, 4):
            f.write(b"z" * 4096)
            f.flush()
            assert os.stat(m.p("grow")).st_size == 4096 * i   # attr not cached while open
            assert os.fstat(f.fileno()).st_size == 4096 * i
            assert f.seek(0, os.SEEK_END) == 4096 * i     # GETATTR with the handle
    assert m.vfs.calls["getattr_fh"] >= 1


def test_write_by_another_user_drops_setuid(mounted):
    m = mounted()
    p = m.p("suid")
    with open(p, "wb") as f:
        f.write(b"#!/bin/sh\n")
    os.chmod(p, 0o4777)
    os.chmod(m.mnt, 0o777)
    os.chmod(os.path.dirname(m.root), 0o755)        # mkdtemp made it 0700
    assert os.stat(p).st_mode & 0o7777 == 0o4777
    subprocess.run([sys.executable, "-c",
                    f"import os; os.setuid(65534); open({p!r}, 'ab').write(b'x')"], check=True)
    assert os.stat(p).st_mode & 0o7777 == 0o0777
    assert os.stat(p).st_size == 11


def test_readdir_many_entries(mounted):
    m = mounted()
    names = sorted(f"file-{i:04d}-{'x' * (i % 40)}" for i in range(700))
    for n in names:
        open(m.p(n), "wb").close()
    assert sorted(os.listdir(m.mnt)) == names
    out = subprocess.run(["ls", "-la", m.mnt], check=True, capture_output=True,
                         text=True).stdout
    assert out.count("file-") == 700 and " .\n" in out and " ..\n" in out
    with os.scandir(m.mnt) as it:
        assert sum(1 for e in it if e.is_file()) == 700


def test_mkdir_race_gives_eexist_not_eio(mounted):
    m = mounted()
    code = ("import os,sys\n"
            "try:\n    os.mkdir(sys.argv[1]); print('ok')\n"
            "except FileExistsError:\n    print('exists')\n")
    for round_ in range(5):
        target = m.p(f"race{round_}")
        procs = [subprocess.Popen([sys.executable, "-c", code, target], stdout=subprocess.PIPE,
                                  text=True) for _ in range(6)]
        outs = [p.communicate()[0].strip() for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
        assert sorted(outs) == ["exists"] * 5 + ["ok"], outs


def test_rename2_flags(mounted):
    m = mounted()
    for n in ("a", "b"):
        with open(m.p(n), "w") as f:
            f.write(n)
    with pytest.raises(OSError) as e:
        renameat2(m.p("a"), m.p("b"), RENAME_NOREPLACE)
    assert e.value.errno == errno.EEXIST
    renameat2(m.p("a"), m.p("c"), RENAME_NOREPLACE)
    assert sorted(os.listdir(m.mnt)) == ["b", "c"]
    with pytest.raises(OSError) as e:
        renameat2(m.p("b"), m.p("c"), RENAME_EXCHANGE)
    assert e.value.errno == errno.EINVAL
    os.rename(m.p("c"), m.p("b"))                   # plain rename over an existing file
    with open(m.p("b")) as f:
        assert f.read() == "a"
    os.mkdir(m.p("d1"))
    os.mkdir(m.p("d2"))
    os.rename(m.p("d1"), m.p("d2"))                 # directory onto an empty directory
    assert sorted(os.listdir(m.mnt)) == ["b", "d2"]


def test_xattrs(mounted):
    m = mounted()
    p = m.p("x")
    open(p, "wb").close()
    with pytest.raises(OSError) as e:
        os.getxattr(p, "user.unknown")
    assert e.value.errno == errno.ENODATA
    assert os.getxattr(p, "user.acache.state") == b"dirty"
    os.setxattr(p, "user.k", b"v" * 300)
    assert os.getxattr(p, "user.k") == b"v" * 300   # python probes with a small buffer first
    assert set(os.listxattr(p)) == {"user.acache.state", "user.k"}
    buf = ctypes.create_string_buffer(10)           # too small: ERANGE
    assert _libc.getxattr(p.encode(), b"user.k", buf, 10) == -1
    assert ctypes.get_errno() == errno.ERANGE
    assert _libc.getxattr(p.encode(), b"user.k", None, 0) == 300   # size probe
    os.removexattr(p, "user.k")
    with pytest.raises(OSError) as e:
        os.removexattr(p, "user.k")
    assert e.value.errno == errno.ENODATA


def test_statfs(mounted):
    m = mounted()
    got, want = os.statvfs(m.mnt), os.statvfs(m.vfs.backing_dir)
    assert got.f_blocks == want.f_blocks and got.f_frsize == want.f_frsize
    assert got.f_namemax == 255


def test_fsync_and_flush_reach_the_vfs(mounted):
    m = mounted()
    fd = os.open(m.p("s"), os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"x" * 1000)
        os.fsync(fd)
        os.fdatasync(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert m.vfs.calls["fsync"] == 2 and m.vfs.calls["fdatasync"] == 1
    assert m.vfs.calls["flush"] == 1                # close(2) -> FLUSH, synchronously
    assert m.counts()["FSYNC"] == 3


def test_non_passthrough_mode_serves_data_itself(mounted):
    m = mounted(passthrough=False)
    assert not m.eng.passthrough_active
    data = os.urandom((2 << 20) + 123)
    with open(m.p("d"), "wb") as f:
        f.write(data)
    with open(m.p("d"), "rb") as f:
        assert f.read() == data
    subprocess.run(["dd", f"if={m.p('d')}", f"of={m.p('e')}", "bs=256k"], check=True,
                   capture_output=True)
    assert _sha(m.p("e")) == hashlib.sha256(data).hexdigest()
    c = m.counts()
    assert c["WRITE"] >= 2 and c["READ"] >= 1, c


def test_remote_file_is_served_by_the_daemon_per_open(mounted):
    """Passthrough is a per-open decision: a file whose data is not local goes through
    the daemon even on a passthrough mount; other files still pass through."""
    m = mounted()
    m.vfs.remote_names.add(b"remote.bin")
    with open(m.p("remote.bin"), "wb") as f:
        f.write(b"r" * 50_000)
    assert m.counts().get("WRITE", 0) >= 1
    with open(m.p("remote.bin"), "rb") as f1, open(m.p("remote.bin"), "rb") as f2:
        assert f1.read() == f2.read() == b"r" * 50_000
    writes = m.counts().get("WRITE", 0)
    with open(m.p("local.bin"), "wb") as f:
        f.write(b"l" * 50_000)
    assert m.counts().get("WRITE", 0) == writes


# --- kernel facts --------------------------------------------------------------------------

def test_writeback_cache_turns_passthrough_off(mounted):
    """Asking for the writeback cache too makes the kernel silently refuse passthrough:
    BACKING_OPEN then fails with EPERM, so the engine serves I/O itself."""
    m = mounted(writeback_cache=True)
    assert m.eng.init.passthrough                   # we did ask for it
    assert not m.eng.passthrough_active
    with open(m.p("w"), "wb") as f:
        f.write(b"w" * 10000)
        with pytest.raises(OSError) as e:
            pt.backing_open(m.eng.devfd, f.fileno())
        assert e.value.errno == errno.EPERM
    with open(m.p("w"), "rb") as f:
        assert f.read() == b"w" * 10000
    assert m.counts()["WRITE"] >= 1


def test_keep_cache_with_passthrough_is_eio(mounted, monkeypatch):
    m = mounted()
    real_open = m.eng._ops.table.open

    def with_keep_cache(*a, **kw):
        flags, backing = real_open(*a, **kw)
        return flags | proto.FOPEN_KEEP_CACHE, backing
    monkeypatch.setattr(m.eng._ops.table, "open", with_keep_cache)
    with pytest.raises(OSError) as e:
        open(m.p("k"), "wb").close()
    assert e.value.errno == errno.EIO
    monkeypatch.undo()
    # the kernel sent RELEASE for the failed open: the engine dropped its backing id
    deadline = time.time() + 5
    while m.vfs.handles and time.time() < deadline:
        time.sleep(0.01)
    assert not m.vfs.handles


def test_new_generation_waits_for_old_passthrough_opens(mounted):
    m = mounted(cow_on_write=True, conflict_wait=0.5)
    with open(m.p("g"), "wb") as f:
        f.write(b"old")
    reader = open(m.p("g"), "rb")
    try:
        with pytest.raises(OSError) as e:           # old generation still passed through
            open(m.p("g"), "r+b")
        assert e.value.errno == errno.EBUSY
        assert reader.read() == b"old"
    finally:
        reader.close()
    r2 = open(m.p("g"), "rb")
    closer = threading.Timer(0.1, r2.close)          # released while the writer waits
    closer.start()
    with open(m.p("g"), "r+b") as f:
        f.write(b"NEW")
    closer.join()
    with open(m.p("g"), "rb") as f:
        assert f.read() == b"NEW"


# --- concurrency, interrupts, lifecycle ----------------------------------------------------

def test_slow_lookup_does_not_stall_others(mounted):
    m = mounted()
    os.mkdir(m.p("slow"))
    open(m.p("fast"), "wb").close()
    m.vfs.lookup_delay[b"slow"] = 3.0
    done = threading.Event()
    t = threading.Thread(target=lambda: (subprocess.run(["stat", m.p("slow")],
                                                        capture_output=True), done.set()))
    # let the kernel forget the cached entry first so that stat really asks us
    time.sleep(1.2)
    t.start()
    while not m.vfs.lookups_running[b"slow"]:
        time.sleep(0.01)
    subprocess.run(["stat", m.p("fast")], check=True, capture_output=True)
    os.listdir(m.mnt)
    assert not done.is_set()                        # answered while the slow one still ran
    t.join()


def test_interrupted_lookup_is_answered_and_undone(mounted):
    m = mounted()
    os.mkdir(m.p("slowdir"))
    time.sleep(1.2)                                 # entry timeout: the next stat asks us
    m.vfs.lookup_delay[b"slowdir"] = 3.0
    child = subprocess.Popen(["stat", m.p("slowdir")], stdout=subprocess.DEVNULL)
    while not m.vfs.lookups_running[b"slowdir"]:
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=2)                           # did not wait for the slow lookup
    assert m.vfs.lookups_running[b"slowdir"] == 1
    while m.vfs.lookups_running[b"slowdir"]:
        time.sleep(0.05)
    time.sleep(0.1)
    node = m.vfs.nodes[m.vfs.nodes[1].children[b"slowdir"]]
    assert node.lookups >= 0 and not m.vfs.violations


def test_stop_is_idempotent_and_wait_returns(mounted):
    m = mounted()
    waiter = threading.Thread(target=m.eng.wait)
    waiter.start()
    m.eng.stop()
    m.eng.stop()
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert not os.path.ismount(m.mnt)


def test_external_umount_ends_the_session(mounted):
    m = mounted()
    with open(m.p("f"), "wb") as f:
        f.write(b"1")
    subprocess.run(["umount", m.mnt], check=True)
    waiter = threading.Thread(target=m.eng.wait)
    waiter.start()
    waiter.join(timeout=10)
    assert not waiter.is_alive()


def test_stop_with_a_busy_mount_aborts_it(mounted):
    m = mounted()
    f = open(m.p("held"), "wb")
    try:
        m.eng.stop(timeout=1.0)
        assert not os.path.ismount(m.mnt)
        assert not m.vfs.handles                    # the engine released what it held
    finally:
        try:
            f.close()
        except OSError:
            pass


def test_clean_stale_mount(tmp_path):
    mnt = tmp_path / "stale"
    mnt.mkdir()
    assert clean_stale_mount(str(mnt)) is False     # a plain directory
    devfd = native_mount.open_device()
    native_mount.mount_fuse(devfd, str(mnt))
    os.close(devfd)                                 # the "daemon" dies without unmounting
    with pytest.raises(OSError) as e:
        os.stat(mnt)
    assert e.value.errno == errno.ENOTCONN
    assert clean_stale_mount(str(mnt)) is True
    assert not os.path.ismount(mnt) and os.path.isdir(mnt)


def test_engine_start_over_a_stale_mount(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    devfd = native_mount.open_device()
    native_mount.mount_fuse(devfd, str(mnt))
    os.close(devfd)
    vfs = MemVFS(str(tmp_path / "cache"))
    eng = NativeEngine(vfs, str(mnt), passthrough=True, threads=2)
    eng.start()
    try:
        open(mnt / "ok", "wb").close()
        assert os.listdir(mnt) == ["ok"]
    finally:
        eng.stop()
    assert not os.path.ismount(mnt)


def test_lookup_counts_return_to_zero_after_forget(mounted):
    """LOOKUP and READDIRPLUS hand out lookup references; when the kernel evicts the
    inodes it forgets them (FORGET / BATCH_FORGET) and every count must come back to 0."""
    m = mounted()
    os.mkdir(m.p("d"))
    for i in range(300):
        with open(m.p("d", f"f{i}"), "wb") as f:
            f.write(b"x")
    subprocess.run(["ls", "-l", m.p("d")], check=True, capture_output=True)
    for i in range(0, 300, 7):
        os.stat(m.p("d", f"f{i}"))
    assert any(n.lookups > 0 for n in m.vfs.nodes.values() if n.ino != 1)
    with open("/proc/sys/vm/drop_caches", "w") as f:     # evict dentries and inodes
        f.write("2")
    deadline = time.time() + 10
    while time.time() < deadline:
        if all(n.lookups == 0 for n in m.vfs.nodes.values() if n.ino != 1):
            break
        time.sleep(0.05)
    left = {n.ino: n.lookups for n in m.vfs.nodes.values() if n.ino != 1 and n.lookups}
    assert not left
    c = m.counts()
    assert c.get("BATCH_FORGET", 0) + c.get("FORGET", 0) > 0, c
