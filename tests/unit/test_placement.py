"""Placement of cacheless clients' files (acache.cluster.placement) and its config key."""
from __future__ import annotations

import pytest

from acache import config
from acache.cluster.placement import bounded, rendezvous, score
from acache.errors import ConfigError


def test_rendezvous_moves_only_what_the_new_worker_wins():
    inos = range(2, 3002)
    three = {i: rendezvous(i, ["w1", "w2", "w3"]) for i in inos}
    four = {i: rendezvous(i, ["w1", "w2", "w3", "w4"]) for i in inos}
    moved = [i for i in inos if three[i] != four[i]]
    assert all(four[i] == "w4" for i in moved)              # nothing moves between old workers
    assert 0.15 < len(moved) / len(inos) < 0.35              # about a quarter goes to the new one
    counts = {w: sum(1 for v in three.values() if v == w) for w in ("w1", "w2", "w3")}
    assert min(counts.values()) > 0.28 * len(inos)           # spread evenly
    # a worker leaving: only its inodes move
    two = {i: rendezvous(i, ["w1", "w3"]) for i in inos}
    assert all(two[i] == three[i] for i in inos if three[i] != "w2")


def test_bounded_loads_even_out_files_open_together():
    workers = ["w1", "w2", "w3"]
    # nothing open: the plain rendezvous choice
    assert all(bounded(i, workers, {}) == rendezvous(i, workers) for i in range(2, 500))
    # 18 files opened one after another, all still open (18 ranks saving at once): 6 each,
    # where the hash alone gives these inodes an uneven share
    for first in (2, 1000, 77_777):
        load: dict[str, int] = {}
        plain: dict[str, int] = {}
        for ino in range(first, first + 18):
            w = bounded(ino, workers, load)
            order = sorted(workers, key=lambda n: (score(n, ino), n), reverse=True)
            cap = -(-(sum(load.values()) + 1) // 3)
            # the first worker in the inode's own order that is below the cap
            assert w == next(n for n in order if load.get(n, 0) < cap)
            load[w] = load.get(w, 0) + 1
            r = rendezvous(ino, workers)
            plain[r] = plain.get(r, 0) + 1
        assert load == {"w1": 6, "w2": 6, "w3": 6}, (first, load)
    assert any(v != 6 for v in plain.values())      # (the last range) the hash alone: uneven


def test_bounded_skips_a_loaded_worker_and_ignores_gone_ones():
    workers = ["w1", "w2", "w3"]
    ino = 4242
    order = sorted(workers, key=lambda n: (score(n, ino), n), reverse=True)
    first, second = order[0], order[1]
    assert bounded(ino, workers, {first: 1}) == second           # cap 1: the next in order
    assert bounded(ino, workers, {first: 1, second: 1}) == order[2]
    assert bounded(ino, workers, {first: 1, second: 1, order[2]: 1}) == first    # cap 2
    # a worker no longer live counts for nothing (its files are not "open on" a live one)
    assert bounded(ino, workers, {"gone": 50}) == first
    # whatever the loads, the choice is a live worker below the cap
    import random
    rnd = random.Random(7)
    for _ in range(2000):
        n = rnd.randint(1, 6)
        ws = [f"w{k}" for k in range(n)]
        load = {w: rnd.randint(0, 9) for w in ws if rnd.random() < 0.8}
        w = bounded(rnd.randint(2, 1 << 40), ws, load)
        assert w in ws and load.get(w, 0) < -(-(sum(load.values()) + 1) // n)


def test_placement_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("ACACHE_HOME", str(tmp_path))
    assert config.load().placement == "local"
    with pytest.raises(ConfigError, match="needs a cluster"):
        config.load(placement="hash")
    with pytest.raises(ConfigError, match="--no-cache"):
        config.load(placement="hash")
    s = config.load(placement="hash", meta="etcd://127.0.0.1:2379/c", listen="127.0.0.1:7470")
    assert s.placement == "hash" and s.source("placement") == "--no-cache"
    (tmp_path / "config.toml").write_text('placement = "nowhere"\n')
    with pytest.raises(ConfigError, match="expected one of local, hash"):
        config.load()
