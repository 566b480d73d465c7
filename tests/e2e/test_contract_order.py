"""Contract, point 4: files become visible in the under-storage in the order they
were closed; a commit marker never lands before the shards written before it."""
from __future__ import annotations

import os

from tests.e2e.contract_util import Poller, pattern, ufs_real

# big shards first: parallel uploads finish the small later ones first, so any
# commit out of order would show in the under-storage
SIZES = [24 << 20, 12 << 20, 1 << 20, 300_000, 4096, 100, 2 << 20, 10]


def _check_prefix(snaps, names: list[str], sizes: dict[str, int]) -> int:
    """Every snapshot shows a prefix of ``names``, each file whole.  Returns how many
    distinct states were seen."""
    states = set()
    for snap in snaps:
        seen = [nm for nm in names if nm in snap]
        assert seen == names[:len(seen)], f"not a prefix of the close order: {sorted(snap)}"
        for nm in seen:
            assert snap[nm] == sizes[nm], f"{nm} visible with {snap[nm]} of {sizes[nm]} bytes"
        assert set(snap) <= set(names), f"unexpected names {set(snap) - set(names)}"
        states.add(len(seen))
    return len(states)


def test_marker_never_before_shards_paused_persister(make_node):
    n = make_node(flush_delay=3600, extra_env={"ACACHE_UPLOAD_CONCURRENCY": "8"})
    d = n.mnt / "step-100"
    d.mkdir()
    names, sizes, data = [], {}, {}
    for i, size in enumerate(SIZES):
        nm = f"step-100/__{i}_0.distcp"
        data[nm] = pattern(size, i)
        (n.mnt / nm).write_bytes(data[nm])
        names.append(nm)
        sizes[nm] = size
    data["step-100/.metadata"] = b"marker"
    with open(d / ".metadata.tmp", "wb") as f:
        f.write(b"marker")
    os.rename(d / ".metadata.tmp", d / ".metadata")
    names.append("step-100/.metadata")
    sizes["step-100/.metadata"] = 6
    data["latest"] = b"100"
    (n.mnt / "latest").write_bytes(b"100")
    names.append("latest")
    sizes["latest"] = 3
    assert ufs_real(n.ufs_files()) == {}     # paused: nothing yet
    with Poller(n.ufs_dir) as poll:
        n.flush()                           # one flush releases everything at once
    _check_prefix(poll.snaps, names, sizes)
    assert ufs_real(n.ufs_files()) == data


def test_ordering_under_continuous_writes(make_node):
    n = make_node(flush_delay=0, extra_env={"ACACHE_UPLOAD_CONCURRENCY": "8"})
    names, sizes = [], {}
    with Poller(n.ufs_dir) as poll:
        for step in range(3):
            for i, size in enumerate(SIZES[:6]):
                nm = f"s{step}/rank{i}.pt"
                if i == 0:
                    (n.mnt / f"s{step}").mkdir()
                (n.mnt / nm).write_bytes(pattern(size, i + step))
                names.append(nm)
                sizes[nm] = size
            nm = f"s{step}/_SUCCESS"
            (n.mnt / nm).write_bytes(b"")
            names.append(nm)
            sizes[nm] = 0
        n.flush()
    _check_prefix(poll.snaps, names, sizes)
    assert sorted(ufs_real(n.ufs_files())) == sorted(names)


def test_after_flush_earlier_files_present(make_node):
    """The marker-last pattern after a crash mid-persist: whatever is in the
    under-storage is still a prefix, and flush completes it."""
    n = make_node(flush_delay=0)
    names = []
    for i, size in enumerate(SIZES):
        nm = f"shard{i}"
        (n.mnt / nm).write_bytes(pattern(size, i))
        names.append(nm)
    (n.mnt / "latest_checkpointed_iteration.txt").write_bytes(b"1")
    names.append("latest_checkpointed_iteration.txt")
    n.kill9()
    snap = sorted(ufs_real(n.ufs_files()))
    got = [nm for nm in names if nm in snap]
    assert got == names[:len(got)]
    n.restart()
    n.flush()
    assert sorted(ufs_real(n.ufs_files())) == sorted(names)


def test_ranks_closing_at_once_then_marker_after_barrier(make_node):
    """Point 4 as DCP uses it: 8 ranks write and close their shards at the same moment
    (their commits may run in parallel, in any order), a barrier, then the marker: it
    never lands before any shard, in every snapshot of the under-storage."""
    import threading
    n = make_node(flush_delay=3600, extra_env={"ACACHE_UPLOAD_CONCURRENCY": "8"})
    (n.mnt / "ck").mkdir()
    ranks = 8
    data = {f"ck/__{r}_0.distcp": pattern(SIZES[r % len(SIZES)], r) for r in range(ranks)}
    go = threading.Barrier(ranks)
    errors = []

    def rank(nm: str) -> None:
        try:
            f = open(n.mnt / nm, "wb")
            f.write(data[nm])
            go.wait(30)                 # every rank closes at the same moment
            f.close()
        except BaseException as e:   # reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(nm,)) for nm in data]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    (n.mnt / "ck/.metadata").write_bytes(b"marker")
    data["ck/.metadata"] = b"marker"
    with Poller(n.ufs_dir) as poll:
        n.flush()
    for snap in poll.snaps:
        if "ck/.metadata" in snap:
            assert all(snap.get(nm) == len(d) for nm, d in data.items()), \
                f"the marker landed before a shard: {sorted(snap)}"
    assert ufs_real(n.ufs_files()) == data
