"""Metadata operations cost few FUSE requests on the native engine (speed is measured by
scripts/bench case 6; these count requests, which timing noise cannot blur)."""
import os
import time

import pytest

from tests.acache_node import fuse_mounts

VARIANTS = {"native": {}, "native-nopt": {"ACACHE_PASSTHROUGH": "0"}}


@pytest.fixture(params=list(VARIANTS))
def native_node(request, make_node):
    n = make_node(extra_env=VARIANTS[request.param])
    yield n
    n.stop()
    assert str(n.mnt) not in fuse_mounts()


@pytest.fixture
def engine():          # make_node's engine: these tests are about the native engine
    return "native"


def _lookups(node) -> int:
    return node.status()["fuse_requests"].get("LOOKUP", 0)


def test_names_stay_known_to_the_kernel_past_a_second(native_node):
    # the kernel forgot every name after 1 s, so each stat/rename/utime/unlink of a file not
    # touched for a second started with a LOOKUP of it (a third of a rename's requests)
    d = native_node.mnt / "ck"
    d.mkdir()
    (d / "a").write_bytes(b"x" * 10)
    (d / "b").write_bytes(b"y" * 20)
    time.sleep(1.5)                    # past the old entry timeout (what is tested is a timeout)
    before = _lookups(native_node)
    assert os.stat(d / "a").st_size == 10
    os.utime(d / "a", ns=(10**18, 10**18))
    os.rename(d / "b", d / "c")        # one LOOKUP: the new name, which does not exist
    assert _lookups(native_node) - before == 1
    assert os.stat(d / "a").st_mtime_ns == 10**18
    assert sorted(os.listdir(d)) == ["a", "c"] and (d / "c").read_bytes() == b"y" * 20
    os.unlink(d / "a")
    assert not (d / "a").exists() and sorted(os.listdir(d)) == ["c"]
    native_node.flush()
    assert native_node.ufs_files() == {"ck/c": b"y" * 20}


def _requests(node, op: str) -> int:
    return node.status()["fuse_requests"].get(op, 0)


def test_a_missing_name_is_looked_up_once(native_node):
    # the kernel keeps the miss: the exists-check of a save and its create cost one LOOKUP
    d = native_node.mnt / "ck"
    d.mkdir()
    before = _lookups(native_node)
    for _ in range(3):
        assert not (d / "model.pt").exists()
    (d / "model.pt").write_bytes(b"z" * 5)
    assert (d / "model.pt").read_bytes() == b"z" * 5
    assert _lookups(native_node) - before == 1
    os.unlink(d / "model.pt")
    assert not (d / "model.pt").exists()
    native_node.flush()
    assert native_node.ufs_files() == {}


def test_a_read_only_close_sends_no_flush(native_node):
    # FLUSH of a read-only handle does nothing, so the kernel is told not to send it
    f = native_node.mnt / "r"
    f.write_bytes(b"q" * 7)
    before = _requests(native_node, "FLUSH")
    for _ in range(5):
        with open(f, "rb") as fh:
            assert fh.read() == b"q" * 7
    assert _requests(native_node, "FLUSH") == before
    with open(f, "ab") as fh:          # a writer's close still flushes (journals the file)
        fh.write(b"!")
    assert _requests(native_node, "FLUSH") == before + 1
    native_node.flush()
    assert native_node.ufs_files() == {"r": b"q" * 7 + b"!"}
