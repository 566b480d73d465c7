"""acache.fs.overlap: which closes overlapped, from FUSE request numbers."""
from acache.fs.overlap import KEEP, Overlap


def test_a_close_made_after_a_reply_lands_after_it_and_one_made_before_may_not():
    o = Overlap()
    o.seen(10)
    o.seen(11)                 # two closes read: 10 and 11, made at about the same time
    assert o.floor(10) == 0
    o.replied(5)               # 10 journaled seq 5 and replies
    assert o.floor(11) == 0    # 11 was made before that reply: may land before seq 5
    assert o.floor(12) == 5    # made after it (its number is higher than any read then)
    o.seen(12)
    o.replied(6)
    assert o.floor(12) == 5 and o.floor(13) == 6


def test_the_highest_number_read_never_goes_back():
    o = Overlap()
    o.seen(20)
    o.seen(7)                  # read late by another thread
    o.replied(3)
    assert o.floor(20) == 0 and o.floor(21) == 3


def test_old_records_count_as_one_conservatively():
    o = Overlap()
    for i in range(1, 3 * KEEP):
        o.seen(i)
        o.replied(i)
    assert o.floor(3 * KEEP) == 3 * KEEP - 1    # after everything
    assert o.floor(2) >= 1                      # dropped records: at least what they said
    assert o.floor(2 * KEEP) == 2 * KEEP - 1


def test_an_engines_floor_never_passes_entries_journaled_without_one():
    # a PUT journaled outside such a close (a truncate of a closed file, a restart's
    # journal) had returned: a close with an engine's floor below it still waits for it
    from acache.meta.kv_mem import MemKV
    from acache.meta.store import MetaStore
    meta = MetaStore(MemKV())
    with meta.lock:
        txn = meta.txn()
        a = txn.append(op="put", path="a", ino=5)           # no floor: after = all before
        txn.commit()
        with meta.op(0):
            txn = meta.txn()
            b = txn.append(op="put", path="b", ino=6)
            txn.commit()
        with meta.op(0):
            txn = meta.txn()
            c = txn.append(op="put", path="c", ino=7)
            txn.commit()
    assert a.after == -1              # (all before it)
    assert b.after == a.seq          # not 0: a was journaled without an engine's floor
    assert c.after == a.seq          # b and c overlapped (the engine said so)
    restarted = MetaStore(meta.kv)
    with restarted.lock, restarted.op(0):
        txn = restarted.txn()
        d = txn.append(op="put", path="d", ino=8)
        txn.commit()
    assert d.after == c.seq          # everything journaled before a restart had returned
