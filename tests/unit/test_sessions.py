"""acache.cluster.sessions: the records a head writes load back in its memory's shapes; the
reaper releases exactly the nodes that have sessions and no live registration."""
from acache.cluster import sessions as S
from acache.meta.kv_mem import MemKV
from acache.meta.store import MetaStore


def test_records_load_back():
    kv = MemKV()
    meta = MetaStore(kv)
    with meta.lock:
        txn = meta.txn()
        S.save_writer(txn, 5, ["n2", 1], None)
        S.save_writer(txn, 6, ["n3", 0], "n1")
        S.save_count(txn, S.read_key(5, 2, "n3"), 2, "n1")
        S.save_count(txn, S.read_key(5, 2, "n4"), 1, "n1")
        S.save_count(txn, S.pin_key(7, 1, "n2"), 1, "n4")
        txn.commit()
    got = S.load(kv)
    assert got.writers == {5: ["n2", 1], 6: ["n3", 0]}
    assert got.placed == {6: "n1"}
    assert got.ropens == {(5, 2): {"n3": 2, "n4": 1}}
    assert got.pinned == {(7, 1): {"n2": 1}}
    assert got.holder_of == {(5, 2): "n1", (7, 1): "n4"}
    assert S.nodes_of(got.writers.values(), got.ropens.values(), got.pinned.values()) == \
        {"n2", "n3", "n4"}
    with meta.lock:                      # ended sessions and counts down to 0: gone
        txn = meta.txn()
        S.save_writer(txn, 5, None, None)
        S.save_count(txn, S.read_key(5, 2, "n4"), 0, "n1")
        txn.commit()
    got = S.load(kv)
    assert got.writers == {6: ["n3", 0]} and got.ropens == {(5, 2): {"n3": 2}}
    meta.close()


def test_the_reaper_releases_gone_nodes_only():
    released: list[str] = []
    alive: set[str] | None = {"n1", "n2"}
    r = S.Reaper(lambda: {"n2", "n3", "n4"}, lambda: alive, released.append, every=3600)
    try:
        assert r.once() == ["n3", "n4"] and released == ["n3", "n4"]
        alive = None                     # etcd does not answer: nothing released
        assert r.once() == []
    finally:
        r.close()
