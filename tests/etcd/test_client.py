"""The etcd client on a real one-member cluster: reads, txns, pagination, leases, watch,
lost replies (the retry rule), compaction."""
from __future__ import annotations

import threading

import pytest

from acache.errors import ConfigError, MetaError
from acache.meta.etcd import (CompactedError, Compare, Compactor, Delete, EtcdClient, Put, Range,
                              parse_url, prefix_end)
from acache.meta.kv_etcd import EtcdKV
from tests.etcd.helpers import LossyClient, wait_for


@pytest.fixture
def client(etcd1, etcd_name):
    c = EtcdClient.from_url(etcd1.url(etcd_name), stall_timeout=10)
    yield c
    c.close()


def test_parse_url():
    u = parse_url("etcd://h1:2379,h2,10.0.0.3:2390/prod-1?stall_timeout=5")
    assert u.endpoints == ("h1:2379", "h2:2379", "10.0.0.3:2390")
    assert u.name == "prod-1" and u.prefix == b"/acache/prod-1/" and u.options == {"stall_timeout": "5"}
    assert EtcdClient.from_url("etcd://a:1/x?stall_timeout=5").stall_timeout == 5.0
    for bad in ("etcd://h1:2379", "etcd://h1:2379/", "etcd:///x", "etcd://h:port/x", "etcd://h/a/b",
                "rocksdb:///x"):
        with pytest.raises(ConfigError):
            parse_url(bad)


def test_prefix_end():
    assert prefix_end(b"a") == b"b" and prefix_end(b"a\xff") == b"b" and prefix_end(b"\xff") == b"\x00"


def test_txn_compares_and_ops(client):
    p = client.prefix
    rev = client.put(p + b"a", b"1")
    kv = client.get(p + b"a")
    assert kv is not None and (kv.value, kv.mod_revision, kv.version) == (b"1", rev, 1)
    # every compare kind, true and false
    assert client.txn([Compare.mod_revision(p + b"a", rev), Compare.version(p + b"a", 1),
                       Compare.value(p + b"a", b"1"), Compare.absent(p + b"b")],
                      [Put(p + b"b", b"2")]).succeeded
    for c in (Compare.mod_revision(p + b"a", rev + 1), Compare.version(p + b"a", 2),
              Compare.value(p + b"a", b"x"), Compare.absent(p + b"b"), Compare.value(p + b"zz", b"")):
        res = client.txn([c], [Put(p + b"c", b"no")], [Range(p + b"a")])
        assert not res.succeeded, c
        assert res.responses[0][0].value == b"1"                   # the failure branch ran
    assert client.get(p + b"c") is None
    res = client.txn([], [Delete(p + b"a"), Range.prefix(p)])
    assert [k.key for k in res.responses[1]] == [p + b"b"]
    assert res.revision == client.revision()


def test_range_is_paginated_in_order_at_one_revision(client):
    p = client.prefix + b"r/"
    keys = [p + bytes([0, i, 0xFF]) for i in range(37)]
    client.txn([], [Put(k, b"v") for k in reversed(keys)])
    it = client.range_prefix(p, page=5)
    first = [next(it) for _ in range(6)]            # two pages read
    client.put(p + b"\x00\x05\x00", b"late")        # a write between pages: not in the snapshot
    got = first + list(it)
    assert [k.key for k in got] == keys
    assert len(list(client.range_prefix(p, page=5))) == 38


def test_lease_keepalive_and_revoke(client):
    k = client.prefix + b"leased"
    lease = client.lease_grant(2)
    client.put(k, b"x", lease)
    ka = client.keepalive(lease, 2)
    lost = threading.Event()
    short = client.lease_grant(2)
    client.put(k + b"2", b"y", short)
    client.keepalive(short, 2, on_lost=lambda _id: lost.set()).stop()   # never refreshed
    wait_for(lambda: client.get(k + b"2") is None, 8, "the unrefreshed lease to expire")
    assert client.get(k) is not None, "the kept-alive lease expired"
    assert client.lease_keepalive_once(lease) > 0
    ka.stop()
    client.lease_revoke(lease)
    assert client.get(k) is None
    client.lease_revoke(lease)                      # a second revoke is a no-op
    assert client.lease_keepalive_once(lease) == 0


def test_keepalive_reports_a_lost_lease(client):
    lease = client.lease_grant(3)
    lost: list[int] = []
    ka = client.keepalive(lease, 3, on_lost=lost.append)
    client.lease_revoke(lease)                      # gone behind the keepalive's back
    wait_for(lambda: lost, 5, "on_lost")
    assert lost == [lease] and ka.lost


def test_watch_delivers_in_revision_order_from_a_revision(client):
    p = client.prefix + b"w/"
    start = client.put(p + b"0", b"0")
    client.put(client.prefix + b"elsewhere", b"-")
    client.txn([], [Put(p + b"1", b"1"), Put(p + b"2", b"2")])
    client.delete(p + b"0")
    got: list = []
    w = client.watch_prefix(p, start, got.extend)
    wait_for(lambda: len(got) >= 4, 5, "4 events")
    client.put(p + b"3", b"3")
    wait_for(lambda: len(got) >= 5, 5, "the live event")
    w.stop()
    assert [(e.type, e.kv.key[-1:], e.revision) for e in got] == [
        ("put", b"0", start), ("put", b"1", start + 2), ("put", b"2", start + 2),
        ("delete", b"0", start + 3), ("put", b"3", start + 4)]
    assert w.next_revision == start + 5


# -- the retry rule: replies lost after the write applied ------------------------------------------
def test_kv_write_whose_reply_was_lost_applies_once(etcd1, etcd_name):
    c = LossyClient(etcd1.endpoints, prefix=f"/acache/{etcd_name}/".encode(), stall_timeout=10)
    kv = EtcdKV(c)
    try:
        before = c.revision()
        c.drop = 1
        kv.write({b"k": b"1"})                      # applied, reply lost, retry fails the fence
        assert c.dropped == 1
        assert c.revision() == before + 1, "the write was applied twice"
        kv.write({b"k": b"2"})                      # the fence state followed
        assert kv.get(b"k") == b"2"
        c.every = 3                                  # a big batch with every third reply lost
        kv.write({b"B%03d" % i: b"%d" % i for i in range(300)}, [b"k"])
        c.every = 0
        assert dict(kv.scan(b"B")) == {b"B%03d" % i: b"%d" % i for i in range(300)}
        assert kv.get(b"k") is None
        assert list(c.range_prefix(c.prefix + b"kvmeta/intent")) == []
    finally:
        kv.close()
        c.close()


def test_lease_grant_whose_reply_was_lost_is_one_lease(etcd1, etcd_name):
    c = LossyClient(etcd1.endpoints, prefix=f"/acache/{etcd_name}/".encode(), stall_timeout=10)
    try:
        c.drop = 1
        lease = c.lease_grant(5)
        assert c.dropped == 1 and c.lease_keepalive_once(lease) > 0
        c.lease_revoke(lease)
    finally:
        c.close()


def test_stall_timeout_names_the_endpoints():
    c = EtcdClient(["127.0.0.1:1", "127.0.0.1:2"], stall_timeout=0.5)
    try:
        with pytest.raises(MetaError, match=r"unreachable .*127\.0\.0\.1:1, 127\.0\.0\.1:2"):
            c.put(b"/acache/x/k", b"v")
    finally:
        c.close()


# -- compaction ------------------------------------------------------------------------------
def test_watch_from_a_compacted_revision_is_a_distinct_error(client):
    p = client.prefix + b"c/"
    old = client.put(p + b"a", b"1")
    for i in range(5):
        client.put(p + b"a", b"%d" % i)
    client.compact(old + 3)
    client.compact(old + 1)                         # older than done: a no-op
    errors: list = []
    client.watch_prefix(p, old, lambda evs: None, errors.append)
    wait_for(lambda: errors, 5, "the watch's error")
    assert isinstance(errors[0], CompactedError) and errors[0].compact_revision == old + 3
    with pytest.raises(CompactedError):
        list(client.range_prefix(p, revision=old))
    assert [k.value for k in client.range_prefix(p, revision=old + 3)] == [b"2"]


def test_periodic_compaction_keeps_the_history_bounded(client):
    p = client.prefix + b"pc/"
    comp = client.start_compactor(keep_revisions=20, keep_seconds=0, interval=0.05)
    for i in range(150):
        client.put(p + b"k", b"%d" % i)
    end = client.revision()
    wait_for(lambda: comp.compacted >= end - 20, 10, "compaction to catch up")
    comp.stop()
    assert end - comp.compacted <= 20 + 5
    with pytest.raises(CompactedError):
        client.get(p + b"k", revision=comp.compacted - 1)
    kv = client.get(p + b"k", revision=comp.compacted)
    assert kv is not None


def test_compaction_window_is_the_older_of_revisions_and_time():
    c = Compactor.__new__(Compactor)               # the policy alone, on given clocks
    c.keep_revisions, c.keep_seconds, c._seen = 100, 300.0, []
    assert c.target(0.0, 1000) == 0                  # nothing older than 5 minutes yet
    assert c.target(200.0, 1500) == 0
    assert c.target(301.0, 2000) == 1000             # time: 5 minutes ago it was 1000
    assert c.target(600.0, 2050) == 1500             # at 300 s it was 1500 (< 2050 - 100)
    assert c.target(1000.0, 2060) == 1960            # quiet: the count keeps 100
