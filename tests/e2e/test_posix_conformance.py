"""POSIX behaviour a conformance suite (pjdfstest) and ordinary tools check that the
other e2e suites do not: what a local filesystem does, through real mounts on every
engine (pyfuse3; native with and without kernel passthrough)."""
from __future__ import annotations

import os
import stat
import time

NOBODY = 65534
GROUP = 4242


def _as_nobody(cwd, fn) -> None:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(cwd)       # before the drop: the test's tmp_path is root's alone
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
            code = 0
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0


def test_setgid_directory_gives_its_group_to_new_entries(space):
    # a group-shared checkpoint tree (chmod g+s): what is created in it belongs to the
    # directory's group, and a new directory inherits the bit, as on ext4
    d = space.mnt / "shared"
    d.mkdir()
    os.chown(d, -1, GROUP)
    os.chmod(d, 0o2777)
    (d / "f").write_bytes(b"x")
    (d / "sub").mkdir(mode=0o755)
    os.symlink("f", d / "link")
    os.mknod(d / "node", 0o644 | stat.S_IFREG)
    _as_nobody(d, lambda: (open("by-nobody", "wb").close(), os.mkdir("dir-by-nobody")))
    got = {n: (os.lstat(d / n).st_uid, os.lstat(d / n).st_gid) for n in
           ("f", "sub", "link", "node", "by-nobody", "dir-by-nobody")}
    assert got == {"f": (0, GROUP), "sub": (0, GROUP), "link": (0, GROUP), "node": (0, GROUP),
                   "by-nobody": (NOBODY, GROUP), "dir-by-nobody": (NOBODY, GROUP)}
    assert stat.S_IMODE(os.stat(d / "sub").st_mode) == 0o2755
    assert stat.S_IMODE(os.stat(d / "f").st_mode) & stat.S_ISGID == 0
    # deeper down it goes on: the new directory is set-group-ID too
    (d / "sub" / "deeper").mkdir()
    assert os.stat(d / "sub" / "deeper").st_gid == GROUP
    assert os.stat(d / "sub" / "deeper").st_mode & stat.S_ISGID
    # without the bit: the creator's group, as before
    plain = space.mnt / "plain"
    plain.mkdir()
    os.chown(plain, -1, GROUP)
    (plain / "f").write_bytes(b"x")
    assert os.stat(plain / "f").st_gid == 0
    # and the under-storage gets the same owner
    space.flush()
    assert os.stat(space.ufs_dir / "shared" / "f").st_gid == GROUP
    assert os.stat(space.ufs_dir / "shared" / "sub").st_gid == GROUP


def test_ctime_is_the_last_change_not_a_set_mtime(space):
    # tar, cp -p and touch -d set mtimes in the past or the future: ctime stays the time of
    # the change (ext4), never the mtime given, closed or open for writing
    future, past = 4_102_444_800_000_000_000, 1_000_000_000_000_000_000
    f = space.mnt / "f"
    f.write_bytes(b"x")
    os.utime(f, ns=(future, future))
    after = time.time_ns()
    s = os.stat(f)
    assert s.st_mtime_ns == future
    assert s.st_ctime_ns <= after
    d = space.mnt / "d"
    d.mkdir()
    os.utime(d, ns=(future, future))
    assert os.stat(d).st_ctime_ns <= time.time_ns()
    with open(space.mnt / "g", "wb", buffering=0) as w:
        w.write(b"abc")
        os.utime(w.fileno(), ns=(future, future))
        assert os.fstat(w.fileno()).st_ctime_ns <= time.time_ns()
    assert os.stat(space.mnt / "g").st_ctime_ns <= time.time_ns()
    # a write after a past mtime: mtime and ctime move to the write, ctime never behind
    os.utime(f, ns=(past, past))
    with open(f, "ab", buffering=0) as w:
        w.write(b"y")
        s = os.fstat(w.fileno())
        assert s.st_mtime_ns > past and s.st_ctime_ns >= s.st_mtime_ns
    s = os.stat(f)
    assert s.st_mtime_ns > past and s.st_ctime_ns >= s.st_mtime_ns
    space.flush()
    s = os.stat(f)
    assert s.st_mtime_ns > past and s.st_ctime_ns >= s.st_mtime_ns
