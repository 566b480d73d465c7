"""Cluster primitives on real etcd: leased membership, its watch, inode batches."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from acache.meta.cluster import Cluster
from acache.meta.etcd import EtcdClient
from tests.etcd.helpers import LossyClient, wait_for

REPO = Path(__file__).resolve().parents[2]

_NODE = """
import sys, time
from acache.meta.cluster import Cluster
from acache.meta.etcd import EtcdClient
cl = Cluster(EtcdClient.from_url(sys.argv[1]))
cl.register(sys.argv[2], "10.0.0.9:7070", ("rdma",), ttl=float(sys.argv[3]))
print("registered", flush=True)
time.sleep(600)
"""

_RESERVER = """
import sys
from acache.meta.cluster import Cluster
from acache.meta.etcd import EtcdClient
cl = Cluster(EtcdClient.from_url(sys.argv[1]))
while True:
    r = cl.reserve_inodes(7)
    print(r.start, r.stop, flush=True)
"""


def _child(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_a_killed_member_shows_down_after_its_ttl(etcd1, etcd_name):
    url = etcd1.url(etcd_name)
    c = EtcdClient.from_url(url)
    cl = Cluster(c)
    events: list = []
    w = cl.watch(events.append)
    ttl = 3.0
    child = _child(_NODE, url, "n-child", str(ttl))
    try:
        assert child.stdout.readline().strip() == "registered"
        me = cl.register("n-self", "10.0.0.1:7070", ("passthrough",), ttl=2)
        ms = {m.record.id: m for m in cl.members()}
        assert ms["n-child"].alive and ms["n-self"].alive
        assert ms["n-child"].record.address == "10.0.0.9:7070"
        assert ms["n-child"].record.capabilities == ("rdma",)
        assert abs(ms["n-self"].record.started - time.time()) < 60
        child.kill()
        child.wait(10)
        killed = time.monotonic()
        wait_for(lambda: any(e.node_id == "n-child" and e.change == "down" for e in events),
                 ttl + 5, "the killed member's down event")
        took = time.monotonic() - killed
        print(f"\nkilled member shown down after {took:.2f} s (TTL {ttl} s)")
        assert took >= ttl - 1.5, "down before its lease could have expired"
        ms = {m.record.id: m for m in cl.members()}
        assert not ms["n-child"].alive and ms["n-self"].alive, "the live member's keepalive lapsed"
        me.stop()
        wait_for(lambda: any(e.node_id == "n-self" and e.change == "down" for e in events), 5,
                 "a stopped member's down event")
        assert [e.change for e in events if e.node_id == "n-self"] == ["record", "up", "down"]
        cl.remove("n-child")
        assert [m.record.id for m in cl.members()] == ["n-self"]
    finally:
        child.kill()
        child.wait(10)
        w.stop()
        c.close()


def test_inode_batches_never_overlap(etcd1, etcd_name):
    """Two in-process clients (one losing every 4th reply after it applied) and a child process
    killed -9 while reserving, all at once: no number is handed out twice."""
    url = etcd1.url(etcd_name)
    got: list[range] = []
    lock = threading.Lock()
    prefix = f"/acache/{etcd_name}/".encode()
    clients = [EtcdClient(etcd1.endpoints, prefix=prefix), LossyClient(etcd1.endpoints, prefix=prefix)]
    clients[1].every = 4
    child = _child(_RESERVER, url)
    stop = threading.Event()

    def reserve(c):
        cl = Cluster(c)
        while not stop.is_set():
            r = cl.reserve_inodes(10)
            with lock:
                got.append(r)

    threads = [threading.Thread(target=reserve, args=(c,)) for c in clients]
    try:
        for t in threads:
            t.start()
        lines = [child.stdout.readline() for _ in range(30)]
        child.kill()                            # likely in the middle of a CAS
        child.wait(10)
        lines += child.stdout.read().splitlines()
        wait_for(lambda: len(got) >= 100, 30, "100 reservations in-process")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        for c in clients:
            c.close()
    child_ranges = [range(int(a), int(b)) for a, b in (ln.split() for ln in lines if ln.strip())]
    assert len(child_ranges) >= 30 and clients[1].dropped > 0
    all_ranges = sorted(got + child_ranges, key=lambda r: r.start)
    for a, b in zip(all_ranges, all_ranges[1:]):
        assert a.stop <= b.start, f"overlap: {a} and {b}"
    assert all_ranges[0].start >= 2, "inode 1 is the root"
    # after all that, a fresh client continues above everything handed out
    c = EtcdClient(etcd1.endpoints, prefix=prefix)
    try:
        assert Cluster(c).reserve_inodes(1).start >= all_ranges[-1].stop
    finally:
        c.close()


def test_revision_orders_acknowledged_changes(etcd1, etcd_name):
    c = EtcdClient.from_url(etcd1.url(etcd_name))
    try:
        cl = Cluster(c)
        before = cl.revision()
        rev = c.put(c.prefix + b"x", b"1")
        after = cl.revision()
        assert before < rev <= after
    finally:
        c.close()


def test_one_live_registration_per_id(etcd1, etcd_name):
    """Two processes registering one id at once: exactly one wins, the other gets IdInUse
    naming the winner's address (and leaves no lease behind).  Replacing a registration needs
    the alive key's revision as it was when found stale; an older one is refused."""
    from acache.meta.cluster import IdInUse
    prefix = f"/acache/{etcd_name}/".encode()
    clients = [EtcdClient(etcd1.endpoints, prefix=prefix) for _ in range(2)]
    won: list = []
    lost: list = []
    go = threading.Barrier(2)

    def start(i: int) -> None:
        cl = Cluster(clients[i])
        go.wait()
        try:
            won.append(cl.register("n", f"10.0.0.{i + 1}:7070", ttl=5))
        except IdInUse as e:
            lost.append(e)
    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(won) == 1 and len(lost) == 1, (won, lost)
        winner = won[0].record.address
        assert lost[0].holder.record.address == winner and winner in str(lost[0])
        cl = Cluster(clients[0])
        held = cl.holder("n")
        assert held is not None and held.record.address == winner
        alive = clients[0].get(cl.alive_key("n"))
        assert alive.value == str(won[0].lease_id).encode() and alive.lease == won[0].lease_id
        # a stale registration is replaced with the revision it was found at ...
        again = cl.register("n", "10.0.0.9:7070", ttl=5, expect=held.revision)
        assert cl.holder("n").record.address == "10.0.0.9:7070"
        # ... and not with an older one (someone replaced it since)
        with pytest.raises(IdInUse) as ei:
            Cluster(clients[1]).register("n", "10.0.0.8:7070", ttl=5, expect=held.revision)
        assert "10.0.0.9:7070" in str(ei.value)
        assert Cluster(clients[1]).holder("absent") is None
        again.stop()
        won[0].stop()
    finally:
        for c in clients:
            c.close()


class _LoseTxnReply(LossyClient):
    """Every txn is applied, its first reply lost (sent again: the retry's compare fails)."""

    def txn(self, *a, **kw):
        self.drop = 1
        return super().txn(*a, **kw)


def test_a_registration_whose_reply_was_lost_is_ours(etcd1, etcd_name):
    prefix = f"/acache/{etcd_name}/".encode()
    c = _LoseTxnReply(etcd1.endpoints, prefix=prefix)
    try:
        reg = Cluster(c).register("n", "10.0.0.1:7070", ttl=5)
        assert c.dropped >= 1
        assert c.get(Cluster(c).alive_key("n")).value == str(reg.lease_id).encode()
        reg.stop()
    finally:
        c.close()


def test_a_lost_lease_is_not_registered_again_over_another_process(etcd1, etcd_name):
    """While a node's lease was lost, another process registered its id: the node's
    re-registration leaves that one alone and says so."""
    prefix = f"/acache/{etcd_name}/".encode()
    c1, c2 = (EtcdClient(etcd1.endpoints, prefix=prefix) for _ in range(2))
    try:
        reg = Cluster(c1).register("n", "10.0.0.1:7070", ttl=5)
        reg._ka.stop()                      # its keepalive would put it again by itself
        c1.lease_revoke(reg.lease_id)       # the lease lost (expired): the alive key is gone
        other = Cluster(c2).register("n", "10.0.0.2:7070", ttl=5)
        reg._reput()                        # what the lost keepalive does
        assert reg.taken is not None and reg.taken.record.address == "10.0.0.2:7070"
        assert c1.get(Cluster(c1).alive_key("n")).value == str(other.lease_id).encode()
        other.stop()
    finally:
        c1.close()
        c2.close()
