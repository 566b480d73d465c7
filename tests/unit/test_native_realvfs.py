"""The native engine over acache's own VFS (memory KV, mem:// under-store, real cache dir):
passthrough writes reach the cache files and, after close, the under-store."""
from __future__ import annotations

import errno
import os
import subprocess
import threading
import time

import pytest

from acache.data.cache import CacheDir
from acache.data.persister import Persister
from acache.data.under.mem import MemStore
from acache.fs.native import NativeEngine
from acache.fs.vfs import VFS
from acache.meta.kv_mem import MemKV
from acache.meta.store import MetaStore

try:
    from .native_fixtures import NATIVE_MARKS, tmp_path  # noqa: F401 (a fixture)
except ImportError:
    from native_fixtures import NATIVE_MARKS, tmp_path  # noqa: F401

pytestmark = NATIVE_MARKS


class Node:
    def __init__(self, tmp, passthrough: bool):
        self.store = MemStore("mem://native")
        self.meta = MetaStore(MemKV())
        self.cache = CacheDir(str(tmp / "cache"), 1 << 30, 5)
        self.persister = Persister(self.meta, self.cache, self.store, flush_delay=0.0,
                                   concurrency=2)
        self.vfs = VFS(self.meta, self.cache, self.store, self.persister, chunk_size=1 << 20)
        self.vfs.recover()
        self.persister.start()
        self.mnt = str(tmp / "mnt")
        os.makedirs(self.mnt)
        self.eng = NativeEngine(self.vfs, self.mnt, passthrough=passthrough, threads=4)
        self.eng.start()

    def p(self, *names: str) -> str:
        return os.path.join(self.mnt, *names)

    def drain(self, timeout: float = 20) -> None:
        self.persister.hurry(self.meta.last_seq())
        deadline = time.monotonic() + timeout
        while self.meta.journal_len():
            assert time.monotonic() < deadline, "journal not drained"
            time.sleep(0.02)

    def files(self) -> dict[str, bytes]:
        with self.store.state.lock:
            return {k: v[0] for k, v in self.store.state.files.items()}

    def stop(self) -> None:
        self.eng.stop()
        self.persister.stop()
        assert not os.path.ismount(self.mnt)


@pytest.fixture(params=[True, False], ids=["passthrough", "daemon-io"])
def node(request, tmp_path):
    n = Node(tmp_path, request.param)
    assert n.eng.passthrough_active == request.param
    yield n
    n.stop()


def test_checkpoint_write_close_persist(node):
    os.makedirs(node.p("ckpt", "step1"))
    shards = {f"shard{i}": os.urandom((1 << 20) * (i + 1) + i) for i in range(3)}
    for name, data in shards.items():
        with open(node.p("ckpt", "step1", name), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    with open(node.p("ckpt", "step1", ".metadata"), "wb") as f:
        f.write(b"meta")
    for name, data in shards.items():
        assert os.stat(node.p("ckpt", "step1", name)).st_size == len(data)
        with open(node.p("ckpt", "step1", name), "rb") as f:
            assert f.read() == data
    node.drain()
    files = node.files()
    for name, data in shards.items():
        assert files[f"ckpt/step1/{name}"] == data
    assert files["ckpt/step1/.metadata"] == b"meta"
    assert os.getxattr(node.p("ckpt", "step1", "shard0"), "user.acache.state") == b"persisted"
    with pytest.raises(OSError) as e:
        os.getxattr(node.p("ckpt", "step1", "shard0"), "user.other")
    assert e.value.errno == errno.ENODATA
    c = node.eng.op_counts()
    if node.eng.passthrough_active:
        assert c.get("WRITE", 0) == 0 and c.get("READ", 0) == 0, c
    else:
        assert c["WRITE"] > 0


def test_overwrite_rename_and_append(node):
    with open(node.p("latest.tmp"), "w") as f:
        f.write("100")
    os.rename(node.p("latest.tmp"), node.p("latest"))
    node.drain()
    with open(node.p("latest"), "w") as f:          # O_TRUNC of a persisted file: new gen
        f.write("200")
    with open(node.p("latest"), "a") as f:
        f.write("0")
    with open(node.p("latest")) as f:
        assert f.read() == "2000"
    subprocess.run(["dd", "if=/dev/zero", f"of={node.p('z')}", "bs=1M", "count=8",
                    "conv=fsync"], check=True, capture_output=True)
    assert os.stat(node.p("z")).st_size == 8 << 20
    node.drain()
    files = node.files()
    assert files["latest"] == b"2000" and "latest.tmp" not in files
    assert files["z"] == bytes(8 << 20)


def test_reader_open_while_rewritten(node):
    """A reader holding the old generation open while a writer rewrites the file: with
    passthrough the kernel allows one backing file per inode, so the writer waits for
    the reader (then gets EBUSY); through the daemon both proceed."""
    with open(node.p("f"), "wb") as f:
        f.write(b"old")
    node.drain()
    reader = open(node.p("f"), "rb")
    closer = threading.Timer(0.2, reader.close)
    closer.start()
    with open(node.p("f"), "wb") as f:
        f.write(b"new")
    closer.join()
    with open(node.p("f"), "rb") as f:
        assert f.read() == b"new"
    node.drain()
    assert node.files()["f"] == b"new"


def test_directory_listing_is_kept_by_the_kernel_until_it_changes(node):
    # listing a checkpoint directory again (a loader's glob, `ls`) costs no request; a
    # change through the mount shows in the next listing at once
    d = node.p("ck")
    os.mkdir(d)
    names = {f"shard{i}" for i in range(20)}
    for n in names:
        with open(os.path.join(d, n), "wb") as f:
            f.write(b"x")
    assert set(os.listdir(d)) == names

    def listings() -> int:
        c = node.eng.op_counts()
        return c.get("READDIR", 0) + c.get("READDIRPLUS", 0)
    before = listings()
    for _ in range(3):
        assert set(os.listdir(d)) == names
    assert listings() == before
    with open(os.path.join(d, "new"), "wb") as f:
        f.write(b"y")
    os.unlink(os.path.join(d, "shard0"))
    os.rename(os.path.join(d, "shard1"), os.path.join(d, "moved"))
    os.mkdir(os.path.join(d, "sub"))
    want = names - {"shard0", "shard1"} | {"new", "moved", "sub"}
    assert set(os.listdir(d)) == want
    os.rename(os.path.join(d, "shard2"), node.p("out"))     # moved to another directory
    assert set(os.listdir(d)) == want - {"shard2"}
    assert "out" in os.listdir(node.mnt)


def test_create_costs_no_getattr_of_the_new_file(node):
    # creating a file was LOOKUP, GETATTR (the directory), CREATE, GETATTR (the new file):
    # the CREATE reply's attributes now hold long enough for the kernel's own open
    d = node.p("many")
    os.mkdir(d)
    before = node.eng.op_counts().get("GETATTR", 0)
    n = 20
    for i in range(n):
        fd = os.open(os.path.join(d, f"f{i}"), os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"x" * (100 + i))
            assert os.stat(os.path.join(d, f"f{i}")).st_size == 100 + i   # while open
            os.write(fd, b"y")
            assert os.fstat(fd).st_size == 101 + i
        finally:
            os.close(fd)
    getattrs = node.eng.op_counts().get("GETATTR", 0) - before
    # one for the directory per create (the previous create changed it), and those of the
    # stat/fstat above (the writes drop the kernel's copy): never one after each CREATE
    assert getattrs <= 3 * n + 2, getattrs         # was 4 * n + 1
    assert sorted(os.path.getsize(os.path.join(d, f"f{i}")) for i in range(n)) == \
        [101 + i for i in range(n)]
