"""Contract, point 1 and 5 -- the less common cases real programs hit: renames of
files (and their directories) while open for writing, open-unlinked files, chains
and swaps of renames, shared mmap writes, cp -p, big directories, odd names."""
from __future__ import annotations

import mmap
import os
import shutil
import subprocess

from tests.e2e.contract_util import pattern, ufs_real


def test_rename_file_while_open_for_writing(space):
    m = space.mnt
    f = open(m / "a.tmp", "wb")
    f.write(b"first half ")
    f.flush()
    os.rename(m / "a.tmp", m / "a")
    f.write(b"second half")
    f.close()
    assert (m / "a").read_bytes() == b"first half second half"
    assert os.listdir(m) == ["a"]
    space.flush()
    assert ufs_real(space.ufs_files()) == {"a": b"first half second half"}


def test_rename_directory_while_file_inside_open(space):
    m = space.mnt
    (m / "tmp-checkpoint-5").mkdir()
    (m / "tmp-checkpoint-5" / "done.bin").write_bytes(b"done")
    f = open(m / "tmp-checkpoint-5" / "open.bin", "wb")
    f.write(pattern(1 << 20, 1))
    os.rename(m / "tmp-checkpoint-5", m / "checkpoint-5")
    f.write(b"tail")
    f.close()
    want = {"checkpoint-5/done.bin": b"done", "checkpoint-5/open.bin": pattern(1 << 20, 1) + b"tail"}
    space.flush()
    assert ufs_real(space.ufs_files()) == want
    assert sorted(os.listdir(space.ufs_dir)) == ["checkpoint-5"]


def test_rename_chain_and_swap(space):
    m = space.mnt
    (m / "a").write_bytes(b"A")
    os.rename(m / "a", m / "b")
    os.rename(m / "b", m / "c")
    (m / "x").write_bytes(b"X")
    (m / "y").write_bytes(b"Y")
    space.flush()
    os.rename(m / "x", m / "t")          # swap persisted x and y through t
    os.rename(m / "y", m / "x")
    os.rename(m / "t", m / "y")
    (m / "n1").write_bytes(b"N1")        # and not-yet-persisted ones
    (m / "n2").write_bytes(b"N2")
    os.rename(m / "n1", m / "t")
    os.rename(m / "n2", m / "n1")
    os.rename(m / "t", m / "n2")
    want = {"c": b"A", "x": b"Y", "y": b"X", "n1": b"N2", "n2": b"N1"}
    assert {k: (m / k).read_bytes() for k in want} == want
    space.flush()
    assert ufs_real(space.ufs_files()) == want


def test_rename_onto_file_being_uploaded_and_back(space):
    m = space.mnt
    (m / "ckpt").write_bytes(pattern(16 << 20, 1))       # large: still uploading
    (m / "new").write_bytes(b"new")
    os.rename(m / "new", m / "ckpt")
    space.flush()
    assert ufs_real(space.ufs_files()) == {"ckpt": b"new"}
    # a recreated old name after a rename of a persisted file
    os.rename(m / "ckpt", m / "old")
    (m / "ckpt").write_bytes(b"again")
    space.flush()
    assert ufs_real(space.ufs_files()) == {"ckpt": b"again", "old": b"new"}


def test_open_unlinked_file_still_readable(space):
    m = space.mnt
    data = pattern(300_000, 2)
    (m / "f").write_bytes(data)
    r = open(m / "f", "rb")
    w = open(m / "g", "w+b")
    w.write(b"scratch")
    os.unlink(m / "f")
    os.unlink(m / "g")
    assert r.read() == data
    w.seek(0)
    assert w.read() == b"scratch"
    r.close()
    w.close()
    assert os.listdir(m) == []
    space.flush()
    assert ufs_real(space.ufs_files()) == {}


def test_reader_keeps_content_across_rename_over(space):
    m = space.mnt
    (m / "model").write_bytes(b"old" * 1000)
    r = open(m / "model", "rb")
    (m / "model.tmp").write_bytes(b"new" * 1000)
    os.replace(m / "model.tmp", m / "model")
    assert r.read() == b"old" * 1000
    r.close()
    assert (m / "model").read_bytes() == b"new" * 1000


def test_mmap_shared_write(space):
    p = space.mnt / "shared.bin"
    size = 1 << 20
    with open(p, "wb") as f:
        f.truncate(size)
    with open(p, "r+b") as f:
        mm = mmap.mmap(f.fileno(), size, mmap.MAP_SHARED)
        mm[0:5] = b"hello"
        mm[size - 5:size] = b"world"
        mm.flush()
        mm.close()
    want = b"hello" + b"\0" * (size - 10) + b"world"
    assert p.read_bytes() == want
    space.flush()
    assert ufs_real(space.ufs_files()) == {"shared.bin": want}


def test_cp_preserve_and_touch(space):
    src = space.node.root / "src.bin"
    src.write_bytes(pattern(200_000, 3))
    os.chmod(src, 0o604)
    os.utime(src, ns=(1_500_000_000_000_000_000, 1_600_000_000_000_000_000))
    subprocess.run(["cp", "-p", str(src), str(space.mnt / "copy.bin")], check=True)
    s = os.stat(space.mnt / "copy.bin")
    assert s.st_mtime_ns == 1_600_000_000_000_000_000 and s.st_mode & 0o777 == 0o604
    subprocess.run(["touch", "-d", "2001-01-01 00:00:00 UTC", str(space.mnt / "copy.bin")],
                   check=True)
    assert os.stat(space.mnt / "copy.bin").st_mtime == 978307200
    space.flush()
    assert os.stat(space.mnt / "copy.bin").st_mtime == 978307200
    assert ufs_real(space.ufs_files()) == {"copy.bin": pattern(200_000, 3)}


def test_big_directory_readdir_and_rmtree(space):
    d = space.mnt / "many"
    d.mkdir()
    names = {f"file-{i:05d}.pt" for i in range(600)}
    for nm in names:
        (d / nm).write_bytes(nm.encode())
    assert set(os.listdir(d)) == names
    out = subprocess.run(["sh", "-c", 'ls -f "$1" | wc -l', "sh", d], capture_output=True, text=True,
                         check=True).stdout
    assert int(out) in (600, 602)    # with or without . and ..
    space.flush()
    assert len(ufs_real(space.ufs_files())) == 600
    shutil.rmtree(d)
    space.flush()
    assert ufs_real(space.ufs_files()) == {} and not (space.ufs_dir / "many").exists()


def test_odd_names(space):
    m = space.mnt
    names = ["with space", "ünïcødé-名前", "x" * 255, ".hidden", "a=b&c", "tab\tname"]
    for nm in names:
        (m / nm).write_bytes(nm.encode("utf-8", "surrogateescape"))
    raw = os.fsencode(m) + b"/bad-\xff\xfe"          # not UTF-8
    with open(raw, "wb") as f:
        f.write(b"raw")
    try:
        open(m / ("y" * 256), "wb")
        raise AssertionError("a 256-byte name must fail")
    except OSError as e:
        assert e.errno == 36   # ENAMETOOLONG
    assert set(os.listdir(m)) == set(names) | {os.fsdecode(b"bad-\xff\xfe")}
    space.flush()
    ufs = ufs_real(space.ufs_files())
    for nm in names:
        assert ufs[nm] == nm.encode("utf-8", "surrogateescape")
    assert open(os.fsencode(space.ufs_dir) + b"/bad-\xff\xfe", "rb").read() == b"raw"


def test_empty_files_and_dirs_persist(space):
    m = space.mnt
    (m / "empty.txt").write_bytes(b"")
    os.close(os.open(m / "touched", os.O_CREAT | os.O_WRONLY, 0o644))
    subprocess.run(["touch", str(m / "by-touch")], check=True)
    (m / "d" / "e").mkdir(parents=True)
    space.flush()
    assert ufs_real(space.ufs_files()) == {"empty.txt": b"", "touched": b"", "by-touch": b""}
    assert (space.ufs_dir / "d" / "e").is_dir()


def test_two_writers_one_file(space):
    p = space.mnt / "shared"
    a = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    b = os.open(p, os.O_RDWR)
    os.pwrite(a, b"A" * 10, 0)
    os.pwrite(b, b"B" * 5, 5)
    os.close(a)
    assert os.pread(b, 100, 0) == b"A" * 5 + b"B" * 5
    os.pwrite(b, b"C", 10)
    os.close(b)
    assert p.read_bytes() == b"AAAAABBBBBC"
    space.flush()
    assert ufs_real(space.ufs_files()) == {"shared": b"AAAAABBBBBC"}


def test_child_closing_inherited_fd_does_not_publish_partial_file(space):
    """A forked child (a DataLoader worker, a subprocess) closes its copy of the
    writer's descriptor: that FLUSH is not the writer's close, so the under-storage
    must not show the half-written file while the parent keeps writing."""
    import time
    from tests.e2e.contract_util import Poller
    p = space.mnt / "shard.pt"
    chunk = pattern(256 << 10, 9)
    f = open(p, "wb", buffering=0)
    f.write(chunk)
    pid = os.fork()
    if pid == 0:
        os._exit(0)          # closes the inherited descriptor: a FLUSH
    os.waitpid(pid, 0)
    with Poller(space.ufs_dir) as poll:
        t_end = time.monotonic() + 1.5       # well past the flush delay
        n = 1
        while time.monotonic() < t_end:
            f.write(chunk)
            n += 1
            time.sleep(0.01)
        f.close()
        space.flush()
    partial = {s["shard.pt"] for s in poll.snaps if "shard.pt" in s} - {n * len(chunk)}
    assert not partial, f"the under-storage showed shard.pt with {sorted(partial)} bytes"
    assert ufs_real(space.ufs_files()) == {"shard.pt": chunk * n}
