"""One KV suite for every implementation (RocksDB and memory)."""
import pytest

from acache.meta.kv import open_kv


@pytest.fixture(params=["rocksdb", "mem"])
def kv(request, tmp_path):
    url = f"rocksdb://{tmp_path / 'db'}" if request.param == "rocksdb" else "mem://"
    k = open_kv(url)
    yield k
    k.close()


def test_get_put_delete(kv):
    assert kv.get(b"a") is None
    kv.write({b"a": b"1", b"b": b"2"})
    assert kv.get(b"a") == b"1"
    kv.write({}, [b"a"])
    assert kv.get(b"a") is None and kv.get(b"b") == b"2"


def test_batch_deletes_then_puts(kv):
    kv.write({b"k": b"old"})
    kv.write({b"k": b"new"}, [b"k"])
    assert kv.get(b"k") == b"new"


def test_scan_prefix_in_key_order(kv):
    kv.write({b"J\x00\x02": b"2", b"J\x00\x01": b"1", b"I\x00": b"i", b"J\x01\x00": b"3", b"K": b"k"})
    assert [k for k, _ in kv.scan(b"J")] == [b"J\x00\x01", b"J\x00\x02", b"J\x01\x00"]
    assert list(kv.scan(b"Z")) == []


def test_sync_write_and_binary_values(kv):
    blob = bytes(range(256)) * 10
    kv.write({b"\x00\xff": blob}, sync=True)
    assert kv.get(b"\x00\xff") == blob


def test_rocksdb_survives_reopen(tmp_path):
    url = f"rocksdb://{tmp_path / 'db'}"
    k = open_kv(url)
    k.write({b"x": b"1"})          # not synced: survives a process crash, here a close
    k.close()
    k = open_kv(url)
    assert k.get(b"x") == b"1"
    k.close()


def test_rocksdb_second_opener_gets_a_clear_error(tmp_path):
    from acache.errors import ConfigError
    url = f"rocksdb://{tmp_path / 'db'}"
    k = open_kv(url)
    with pytest.raises(ConfigError, match="metadata database"):
        open_kv(url)
    k.close()
