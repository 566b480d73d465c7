"""Placement of cacheless clients' files (acache.cluster.placement) and its config key."""
from __future__ import annotations

import pytest

from acache import config
from acache.cluster.placement import rendezvous
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
