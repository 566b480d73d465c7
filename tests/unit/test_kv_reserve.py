"""RocksDB on a full filesystem keeps working thanks to the metadata reserve (issue 9,
item 1): a real RocksKV on a small tmpfs that another file fills up."""
import os
import subprocess
import time

import pytest

from acache.data.cache import CacheDir
from acache.meta.kv_rocks import RocksKV
from acache.meta.reserve import Reserve

MiB = 1 << 20


@pytest.fixture
def fs(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("mounting a tmpfs needs root")
    d = tmp_path / "fs"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(d)], check=True)
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def fill(path) -> None:
    """Write ``path`` until the filesystem is full."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"x" * 65536)
                f.flush()
        except OSError:
            pass
        finally:
            try:
                f.close()
            except OSError:
                pass


def test_writes_go_on_when_the_filesystem_fills(fs):
    reserve = Reserve(str(fs / "meta.reserve"), 4 * MiB)
    assert reserve.held
    kv = RocksKV(str(fs / "meta"), reserve)
    kv.write({b"before": b"1"})
    fill(fs / "filler")
    for i in range(2000):                   # ~2 MiB of WAL: more than RocksDB preallocates
        kv.write({b"k%05d" % i: b"v" * 1000})
    assert not reserve.held
    assert kv.get(b"before") == b"1" and kv.get(b"k01999") == b"v" * 1000
    assert len(list(kv.scan(b"k"))) == 2000

    # the ballast comes back once there is room for it again
    os.unlink(fs / "filler")
    deadline = time.monotonic() + 10
    while not reserve.held:
        assert time.monotonic() < deadline, "the reserve was not made again"
        kv.write({b"tick": b""})
        time.sleep(0.1)
    kv.close()


def test_the_database_opens_on_a_full_filesystem(fs):
    reserve = Reserve(str(fs / "meta.reserve"), 4 * MiB)
    kv = RocksKV(str(fs / "meta"), reserve)
    kv.write({b"acknowledged": b"yes"}, sync=True)
    kv.close()
    fill(fs / "filler")
    kv = RocksKV(str(fs / "meta"), Reserve(str(fs / "meta.reserve"), 4 * MiB))
    assert kv.get(b"acknowledged") == b"yes"
    kv.write({b"after": b"1"})
    kv.close()


def test_cache_limit_keeps_the_reserve_free(fs):
    reserve = Reserve(str(fs / "meta.reserve"), 4 * MiB)
    cache = CacheDir(str(fs / "cache"), 1 << 40, 1.0, reserve=reserve)
    st = os.statvfs(fs)
    free = st.f_bavail * st.f_frsize
    assert cache.effective_limit() == free - 4 * MiB
    reserve.release()                       # released: room to make it again is kept too
    cache._fs_next = 0
    assert cache.effective_limit() == free + 4 * MiB - 8 * MiB
