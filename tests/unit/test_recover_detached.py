"""Recovery at start over metadata where a name cannot reach an inode (a directory above it is
missing): the crash loop once left such a state and every `acache up` then failed with a bare
`KeyError: 71` (the missing directory's inode).  Recovery takes such inodes out of the
namespace (their unjournaled bytes to lost+found) instead of failing; and any unexpected
error at start is one line naming what failed, with the traceback in the log."""
import os
import stat as st
import subprocess
import sys
from pathlib import Path

import pytest

from acache.data.cache import CacheDir
from acache.data.persister import Persister
from acache.data.under.mem import MemStore
from acache.fs.types import ROOT_INO, Ctx
from acache.fs.vfs import VFS
from acache.meta import schema as K
from acache.meta.kv_rocks import RocksKV
from acache.meta.store import Entry, Inode, MetaStore, MissingInode

REPO = Path(__file__).resolve().parents[2]
CKPT, STEP_TMP, SHARD, OTHER = 2, 71, 72, 73     # STEP_TMP (a directory) is missing


def _state(kv) -> None:
    """ckpt/ (2), ckpt/other (73, closed, PUT pending), and in ckpt/step_12.tmp (71, whose
    record and entry are gone): shard_0 (72), open for writing at the crash."""
    d = st.S_IFDIR | 0o755
    f = st.S_IFREG | 0o644
    root = Inode(ROOT_INO, d, nlink=3, upath="", cached=True)
    ckpt = Inode(CKPT, d, nlink=2, parent=ROOT_INO, name=b"ckpt", upath="ckpt", cached=True,
                 listed=True)
    shard = Inode(SHARD, f, size=5, parent=STEP_TMP, name=b"shard_0", dirty=True, cached=True)
    other = Inode(OTHER, f, size=3, parent=CKPT, name=b"other", cached=True)
    put = Entry(seq=9, op="put", path="ckpt/other", ino=OTHER, gen=0, size=3)
    kv.write({K.inode_key(n.ino): n.pack() for n in (root, ckpt, shard, other)}
             | {K.dentry_key(ROOT_INO, b"ckpt"): K.u64(CKPT),
                K.dentry_key(CKPT, b"other"): K.u64(OTHER),
                K.dentry_key(STEP_TMP, b"shard_0"): K.u64(SHARD),
                K.journal_key(9): put.pack(),
                K.counter_key("next_ino"): K.u64(OTHER), K.counter_key("next_seq"): K.u64(9)},
             sync=True)


def test_recovery_takes_out_inodes_no_name_reaches(tmp_path):
    kv = RocksKV(str(tmp_path / "meta"))
    _state(kv)
    cache = CacheDir(str(tmp_path / "cache"), 1 << 30, 5)
    Path(cache.path(SHARD, 0)).write_bytes(b"hello")
    Path(cache.path(OTHER, 0)).write_bytes(b"abc")
    meta = MetaStore(kv)
    store = MemStore("mem://t")
    p = Persister(meta, cache, store, flush_delay=0.0)
    vfs = VFS(meta, cache, store, p)
    with pytest.raises(MissingInode, match="^inode 72 has no path: inode 71 above it is missing"):
        meta.path_of(SHARD)
    out = vfs.recover()          # was: KeyError: 71
    assert out["detached"] == 1
    assert meta.get(SHARD) is None
    assert meta.children(STEP_TMP) == {}
    # the bytes nobody journaled are kept aside, never deleted
    kept = os.listdir(cache.lost_dir)
    assert [Path(cache.lost_dir, n).read_bytes() for n in kept] == [b"hello"]
    # the rest is untouched: its pending PUT lands; the namespace works
    assert meta.get(OTHER) is not None and meta.path_of(OTHER) == "ckpt/other"
    assert Path(cache.path(OTHER, 0)).read_bytes() == b"abc"
    p.start()
    try:
        p.hurry(meta.last_seq())
        vfs.mkdir(CKPT, b"step_13", 0o755, Ctx())
        p.cond.acquire()
        try:
            p.cond.wait_for(lambda: meta.journal_len() == 0, timeout=10)
        finally:
            p.cond.release()
        assert store.state.files["ckpt/other"][0] == b"abc"
    finally:
        p.stop()
    kv.close()
    # the state written back is whole: a second start finds nothing to take out
    kv = RocksKV(str(tmp_path / "meta"))
    meta = MetaStore(kv)
    cache = CacheDir(str(tmp_path / "cache"), 1 << 30, 5)
    assert VFS(meta, cache, store, Persister(meta, cache, store)).recover()["detached"] == 0
    kv.close()


def test_unexpected_error_at_start_is_one_line_with_the_traceback_in_the_log(tmp_path):
    """A state the start cannot handle (here a record whose mode is not a number) makes
    `acache up` fail with one line naming the error and where to find the traceback."""
    home = tmp_path / "home"
    kv = RocksKV(str(home / "cache" / "meta"))
    bad = Inode(5, st.S_IFREG | 0o644, parent=ROOT_INO, name=b"x")
    bad.mode = "not a mode"      # type: ignore[assignment]
    kv.write({K.inode_key(5): bad.pack(), K.dentry_key(ROOT_INO, b"x"): K.u64(5),
              K.counter_key("next_ino"): K.u64(5)}, sync=True)
    kv.close()
    env = dict(os.environ, ACACHE_HOME=str(home), ACACHE_UFS=f"file://{tmp_path / 'ufs'}",
               ACACHE_ENGINE="pyfuse3")
    p = subprocess.run([sys.executable, "-m", "acache.cli", "up"], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("acache: error: starting the node failed: internal error "
                               "(TypeError"), lines[0]
    assert str(home / "acache.log") in lines[0]
    log = (home / "acache.log").read_text()
    assert "Traceback (most recent call last)" in log and "starting the node failed" in log
