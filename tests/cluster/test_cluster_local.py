"""A cluster of real nodes on loopback (one etcd, FUSE mounts, a shared file:// under-storage):
read-after-write across nodes, names, one writer per file, the barrier from any node,
ordering across nodes, and kill -9 of a holder and of the head."""
from __future__ import annotations

import errno
import hashlib
import os
import threading
import time

import pytest

from tests.acache_node import fuse_mounts
from tests.cluster_local import LocalCluster
from tests.e2e.conftest import ENGINES, _need_fuse

pytestmark = pytest.mark.usefixtures("need_fuse")


@pytest.fixture
def need_fuse():
    _need_fuse()


@pytest.fixture(params=ENGINES)
def engine(request):
    return request.param


def until(cond, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"{what}: not within {timeout} s")


def test_read_after_write_names_and_persist(tmp_path, etcd1, engine):
    with LocalCluster(tmp_path, etcd1, 2, engine=engine) as c:
        a, b = c.nodes
        (a.mnt / "ckpt").mkdir()
        data = os.urandom((24 << 20) + 12345)
        (a.mnt / "ckpt" / "shard0").write_bytes(data)
        # close returned on A: B opens it now and reads exactly those bytes, from A's cache
        assert hashlib.sha256((b.mnt / "ckpt" / "shard0").read_bytes()).digest() == \
            hashlib.sha256(data).digest()
        assert (b.mnt / "ckpt" / "shard0").stat().st_size == len(data)
        # and the other way; a second read on A (warm) and B's own file
        (b.mnt / "ckpt" / "shard1").write_bytes(b"from b" * 1000)
        assert (a.mnt / "ckpt" / "shard1").read_bytes() == b"from b" * 1000
        # names made on A show on B within the kernel's entry timeout (1 s)
        os.rename(a.mnt / "ckpt", a.mnt / "checkpoint-1")
        until(lambda: sorted(os.listdir(b.mnt)) == ["checkpoint-1"], 3, "rename seen on B")
        os.unlink(b.mnt / "checkpoint-1" / "shard1")
        until(lambda: os.listdir(a.mnt / "checkpoint-1") == ["shard0"], 3, "unlink seen on A")
        b.flush()
        assert c.ufs_files() == {"checkpoint-1/shard0": data}
        st = a.status()["cluster"]
        assert st["queue"] == 0 and st["head"] in ("n1", "n2")
        assert {n["id"]: n["alive"] for n in st["nodes"]} == {"n1": True, "n2": True}


def test_overwrite_and_append_across_nodes(tmp_path, etcd1):
    with LocalCluster(tmp_path, etcd1, 2) as c:
        a, b = c.nodes
        (a.mnt / "f").write_bytes(b"A" * 100_000)
        with open(b.mnt / "f", "ab") as f:          # B copies A's generation, then appends
            f.write(b"B" * 10)
        assert (a.mnt / "f").read_bytes() == b"A" * 100_000 + b"B" * 10
        with open(a.mnt / "f", "r+b") as f:         # back on A: in the middle
            f.seek(5)
            f.write(b"xyz")
        want = b"AAAAAxyz" + b"A" * (100_000 - 8) + b"B" * 10
        assert (b.mnt / "f").read_bytes() == want
        os.truncate(b.mnt / "f", 7)
        assert (a.mnt / "f").read_bytes() == b"AAAAAxy"
        a.flush()
        assert c.ufs_files() == {"f": b"AAAAAxy"}


def test_one_writer_per_file_across_nodes(tmp_path, etcd1):
    with LocalCluster(tmp_path, etcd1, 2) as c:
        a, b = c.nodes
        f = open(a.mnt / "f", "wb")
        try:
            f.write(b"a" * 4096)
            f.flush()
            with pytest.raises(OSError) as ei:
                open(b.mnt / "f", "r+b")
            assert ei.value.errno == errno.EBUSY
            with open(a.mnt / "f", "ab") as again:  # the same node: a second writer is fine
                again.write(b"b")
        finally:
            f.close()
        with open(b.mnt / "f", "ab") as g:           # closed on A: B may write now
            g.write(b"c")
        assert (a.mnt / "f").read_bytes() == b"a" * 4096 + b"bc"
        assert "EBUSY" in a.log_tail(200) or "open for writing" in "".join(
            n.log_tail(200) for n in c.nodes)


def test_barrier_from_any_node_and_order_across_nodes(tmp_path, etcd1):
    """Shard closed on A, then (after A's close returned) marker closed on B: the under-storage
    never shows a marker without its shard, over many rounds; flush --wait on B covers A's."""
    with LocalCluster(tmp_path, etcd1, 2, flush_delay=0.0) as c:
        a, b = c.nodes
        seen_bad: list[str] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                names = set(os.listdir(c.ufs_dir))
                for n in names:
                    if n.startswith("marker-") and "shard-" + n[7:] not in names:
                        seen_bad.append(n)
        t = threading.Thread(target=watch)
        t.start()
        try:
            for i in range(40):
                (a.mnt / f"shard-{i}").write_bytes(os.urandom(2048 + i))
                (b.mnt / f"marker-{i}").write_bytes(b"done")
        finally:
            b.flush()
            stop.set()
            t.join()
        assert not seen_bad, f"markers landed before their shards: {seen_bad[:5]}"
        files = c.ufs_files()
        assert sum(1 for k in files if k.startswith("shard-")) == 40
        assert sum(1 for k in files if k.startswith("marker-")) == 40
        for i in range(40):
            assert (a.mnt / f"shard-{i}").read_bytes() == files[f"shard-{i}"]


def test_kill9_holder_then_restart(tmp_path, etcd1):
    """The non-head node dies holding unpersisted files: persisting waits for it (status names
    it), the head keeps writing, reads of its files fail with EIO, not hang; after a restart
    everything lands byte-identical and flush --wait returns 0."""
    with LocalCluster(tmp_path, etcd1, 2, flush_delay=600) as c:
        head_id = c.wait_head()
        head, other = c.node(head_id), c.nodes[1 if head_id == "n1" else 0]
        theirs = {f"o{i}": os.urandom(300_000 + i) for i in range(5)}
        for k, v in theirs.items():
            (other.mnt / k).write_bytes(v)
        other.kill9()
        mine = os.urandom(100_000)
        (head.mnt / "mine").write_bytes(mine)          # the others keep writing
        t0 = time.monotonic()
        with pytest.raises(OSError) as ei:
            (head.mnt / "o1").read_bytes()
        waited = time.monotonic() - t0
        print(f"read of a dead holder's file: EIO after {waited:.1f} s")
        assert ei.value.errno == errno.EIO and waited < 60
        r = head.cli("flush", "--wait", "--timeout", "3", check=False, timeout=60)
        assert r.returncode != 0
        st = head.status()["cluster"]
        down = [n["id"] for n in st["nodes"] if not n["alive"]]
        assert down == [other.root.name]
        assert st["blocked_by"] == other.root.name and st["blocked_files"] >= 5
        held = {n["id"]: n["held_files"] for n in st["nodes"]}
        assert held[other.root.name] == 5
        text = head.cli("status").stdout
        assert "persisting blocked" in text and f"by node {other.root.name}" in text, text
        other.restart()
        head.flush(timeout=60)
        assert c.ufs_files() == {**theirs, "mine": mine}


def test_kill9_head_another_takes_over(tmp_path, etcd1):
    with LocalCluster(tmp_path, etcd1, 2, flush_delay=600) as c:
        first = c.wait_head()
        old, new = c.node(first), c.nodes[1 if first == "n1" else 0]
        held = os.urandom(200_000)
        (old.mnt / "held-by-old-head").write_bytes(held)
        (new.mnt / "before").write_bytes(b"before")
        old.kill9()
        t0 = time.monotonic()
        (new.mnt / "after").write_bytes(b"after")     # waits for the takeover, then works
        took = time.monotonic() - t0
        assert c.wait_head(not_=first) == new.root.name
        assert sorted(os.listdir(new.mnt)) == ["after", "before", "held-by-old-head"]
        assert took < 30, f"the takeover took {took:.1f} s"
        old.restart()
        assert (old.mnt / "after").read_bytes() == b"after"
        new.flush(timeout=60)
        assert c.ufs_files() == {"held-by-old-head": held, "before": b"before", "after": b"after"}


def test_takeover_under_concurrent_namespace_calls(tmp_path, etcd1):
    """Several threads on the surviving node call the namespace while the head is gone: each
    waiting call campaigns for the role as the campaign thread does.  The node must take the
    role once -- one namespace writer, one persister -- and no call may fail.  (Two
    campaigns that both saw no head used to build two heads; the second fenced the first's
    KV off, and a call on the first got EIO.)"""
    with LocalCluster(tmp_path, etcd1, 2, flush_delay=600) as c:
        first = c.wait_head()
        old, new = c.node(first), c.nodes[1 if first == "n1" else 0]
        for i in range(20):
            (new.mnt / f"pre{i}").write_bytes(b"p" * 100)
        old.kill9()
        errors: list[BaseException] = []

        def work(k: int) -> None:
            try:
                for i in range(15):
                    p = new.mnt / f"t{k}-{i}"
                    p.write_bytes(b"x" * (k + i))
                    os.stat(p)
                    os.rename(p, new.mnt / f"r{k}-{i}")
            except BaseException as e:          # reported below, with the node's log
                errors.append(e)
        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        log_text = (new.home / "acache.log").read_text()
        assert not errors, f"{errors[:3]}\n--- log ---\n{new.log_tail(60)}"
        took = log_text.count(f"this node ({new.root.name}) is the cluster's head now")
        assert took == 1, f"the head role was taken {took} times\n--- log ---\n{new.log_tail(60)}"
        names = set(os.listdir(new.mnt))
        assert {f"r{k}-{i}" for k in range(8) for i in range(15)} <= names
        old.restart()
        new.flush(timeout=120)
        ufs = c.ufs_files()
        assert all(ufs[f"r{k}-{i}"] == b"x" * (k + i) for k in range(8) for i in range(15))


def test_metrics_of_a_member(tmp_path, etcd1):
    from tests.e2e.test_metrics import free_port, scrape
    ports = [free_port(), free_port()]
    with LocalCluster(tmp_path, etcd1, 2, flush_delay=600) as c:
        # the metrics endpoint per node, set through the environment of each node's CLI
        for n, port in zip(c.nodes, ports):
            n.env["ACACHE_METRICS"] = f"127.0.0.1:{port}"
            n.cli("down", "--no-flush")
            n.restart()
        head_id = c.wait_head()
        a, b = c.nodes
        (b.mnt / "x").write_bytes(os.urandom(70_000))
        assert (a.mnt / "x").stat().st_size == 70_000
        (a.mnt / "x").read_bytes()               # over the peer transport from b
        ma = scrape(ports[0])
        assert ma[("acache_cluster_nodes", (("state", "alive"),))] == 2
        assert ma[("acache_cluster_head", ())] == (1 if head_id == "n1" else 0)
        assert ma[("acache_persist_queue_entries", ())] >= 1
        assert ma[("acache_peer_received_bytes_total", (("peer", "n2"), ("transport", "tcp")))] >= 70_000
        assert ma[("acache_peer_up", (("peer", "n2"), ("transport", "tcp")))] == 1
        b.kill9()
        until(lambda: scrape(ports[0])[("acache_cluster_nodes", (("state", "down"),))] == 1, 20,
              "n2 down in the metrics")
        until(lambda: scrape(ports[0]).get(("acache_cluster_persist_blocked", (("node", "n2"),))) == 1
              or head_id == "n2", 20, "persisting blocked by n2")


def test_journal_and_skip_from_any_node(tmp_path, etcd1):
    """The journal is the head's: listed and skipped from a node that is not the head (the
    operator's way out when a node's disk is gone for good)."""
    import json
    with LocalCluster(tmp_path, etcd1, 2, flush_delay=600) as c:
        head_id = c.wait_head()
        other = c.nodes[1 if head_id == "n1" else 0]
        (other.mnt / "lost").write_bytes(b"x" * 1000)
        (other.mnt / "kept").write_bytes(b"y" * 10)
        j = json.loads(other.cli("journal", "--json").stdout)
        seqs = {e["path"]: e["seq"] for e in j["entries"]}
        assert set(seqs) == {"lost", "kept"}
        r = other.cli("journal", "skip", str(seqs["lost"]), check=False)
        assert r.returncode != 0 and "reason" in (r.stderr + r.stdout)
        other.cli("journal", "skip", str(seqs["lost"]), "--reason", "disk gone")
        other.flush(timeout=60)
        assert c.ufs_files() == {"kept": b"y" * 10}


def test_writes_after_a_dup_is_closed_are_not_lost(tmp_path, etcd1):
    """close(2) of a dup'd descriptor sends FLUSH while the owner writes on (a fork + exec
    does the same): the final close journals everything, on the other node and in the
    under-storage."""
    with LocalCluster(tmp_path, etcd1, 2, flush_delay=0.0) as c:
        a, b = c.nodes
        fd = os.open(a.mnt / "f", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"1" * 5000)
        os.close(os.dup(fd))                       # FLUSH: looks closed
        os.write(fd, b"2" * 7000)
        os.ftruncate(fd, 11000)
        os.close(fd)
        want = b"1" * 5000 + b"2" * 6000
        assert (b.mnt / "f").read_bytes() == want
        b.flush()
        assert c.ufs_files() == {"f": want}


def test_rename_of_a_pending_file_held_by_another_node(tmp_path, etcd1):
    """A rename moves a pending PUT to the rename's place in the journal: the moved entry
    must still name the node holding the bytes (it once said nobody: the head then took the
    file for its own, found no bytes and retried forever)."""
    with LocalCluster(tmp_path, etcd1, 2, flush_delay=600) as c:
        head_id = c.wait_head()
        other = c.nodes[1 if head_id == "n1" else 0]
        (other.mnt / "d").mkdir()
        data = os.urandom(300_000)
        (other.mnt / "d" / "x").write_bytes(data)
        os.rename(other.mnt / "d" / "x", other.mnt / "y")
        other.flush(timeout=60)
        assert c.ufs_files() == {"y": data}


def test_meta_setting_errors_are_one_line(tmp_path):
    from tests.acache_node import AcacheNode
    n = AcacheNode(tmp_path / "n")
    r = n.cli("up", "--meta", "bogus", check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("acache: error: --meta: meta = 'bogus': expected"), r.stderr
    r = n.cli("up", "--meta", "etcd://127.0.0.1:1/x", check=False)   # no listen
    assert r.returncode == 1 and "set listen" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_etcd_down_metadata_fails_in_bound_open_files_go_on_then_recovers(tmp_path):
    """etcd unreachable (its one member killed -9): a create waits for it at most
    stall_timeout, then fails with EIO and is applied nowhere; writes into a file already open go
    on; nothing acknowledged before is lost.  etcd back: the same mount works again, the open
    file closes, and everything acknowledged lands in order.  (The head writes etcd behind its
    lock in groups -- store.GroupCommit: the failed group is undone and memory read back from
    etcd once it answers.)"""
    from tests.etcd_server import EtcdCluster
    etcd = EtcdCluster(tmp_path / "etcd", 1)
    etcd.start()
    try:
        with LocalCluster(tmp_path, etcd, 2, flush_delay=600, extra="stall_timeout = 5\n") as c:
            head = c.wait_head()
            b = c.nodes[1 if head == "n1" else 0]       # the member: its calls go over the wire
            before = os.urandom(100_000)
            (b.mnt / "before").write_bytes(before)
            part1, part2 = os.urandom(300_000), os.urandom(200_000)
            f = open(b.mnt / "open", "wb")
            f.write(part1)
            f.flush()
            etcd.kill(etcd.members[0])
            f.write(part2)                            # already open: local, no metadata
            f.flush()
            t0 = time.monotonic()
            with pytest.raises(OSError) as ei:
                (b.mnt / "during").write_bytes(b"never acknowledged")
            took = time.monotonic() - t0
            print(f"create with etcd down: {ei.value.strerror} after {took:.1f} s")
            assert ei.value.errno == errno.EIO, ei.value
            assert took < 5 + 60, f"EIO only after {took:.1f} s (stall_timeout 5 s)"
            etcd.start(etcd.members[0])
            # starting etcd forked: the child's exec closed its copy of f's descriptor, a FLUSH
            # that failed (etcd was not up yet); the owner's close must journal it itself
            f.close()
            until(lambda: _creates(b.mnt / "after"), timeout=60, what="a create after etcd returned")
            assert (b.mnt / "before").read_bytes() == before
            assert (b.mnt / "open").read_bytes() == part1 + part2
            assert "during" not in os.listdir(b.mnt)
            b.flush(timeout=120)
            assert c.ufs_files() == {"before": before, "open": part1 + part2, "after": b"after"}
    finally:
        etcd.stop()


def _creates(path) -> bool:
    try:
        path.write_bytes(b"after")
        return True
    except OSError as e:
        if e.errno != errno.EIO:
            raise
        return False


def _etcd_state(c: LocalCluster, node_id: str) -> dict:
    """What a second node under ``node_id`` must leave alone: the node's record and alive
    key, the head key, the namespace's fence (value, mod_revision, lease of each)."""
    from acache.meta.etcd import EtcdClient
    e = EtcdClient.from_url(c.url)
    try:
        keys = [f"members/node/{node_id}", f"members/alive/{node_id}", "head", "ns/kvmeta/fence"]
        out = {}
        for k in keys:
            kv = e.get(e.prefix + k.encode())
            out[k] = None if kv is None else (kv.value, kv.mod_revision, kv.lease)
        return out
    finally:
        e.close()


def test_a_second_node_with_a_live_node_id_refuses(tmp_path, etcd1):
    """Two nodes started with one node_id (two pods with one host name): the second's `up`
    and `mount` exit non-zero with one line naming the id, the first's address and node_id;
    the first notices nothing (etcd's keys of it untouched, its mount works, it is head)."""
    from tests.acache_node import AcacheNode
    from tests.cluster_local import free_port
    with LocalCluster(tmp_path, etcd1, 1) as c:
        first = c.nodes[0]
        assert c.wait_head() == "n1"
        (first.mnt / "before").write_bytes(b"before")
        addr = next(ln for ln in (first.home / "config.toml").read_text().splitlines()
                    if ln.startswith("listen")).split('"')[1]
        before = _etcd_state(c, "n1")
        assert before["members/alive/n1"] is not None and before["head"] is not None
        dup = AcacheNode(tmp_path / "dup", ufs=c.ufs,
                         config=f'meta = "{c.url}"\nlisten = "127.0.0.1:{free_port()}"\n'
                                f'node_id = "n1"\n')
        try:
            for cmd in (["up"], ["mount", str(dup.mnt)]):
                r = dup.cli(*cmd, check=False, timeout=120)
                lines = r.stderr.strip().splitlines()
                print(f"acache {cmd[0]}: exit {r.returncode}: {r.stderr.strip()}")
                assert r.returncode != 0 and len(lines) == 1, r.stderr
                assert "Traceback" not in r.stderr and "Traceback" not in dup.log_tail(400)
                line = lines[0]
                assert line.startswith("acache: error: node_id 'n1' is in use"), line
                assert addr in line and "another node_id" in line, line
                assert dup.pid() is None, "the refused node is still running"
            assert str(dup.mnt) not in fuse_mounts()
        finally:
            dup.stop()
        assert _etcd_state(c, "n1") == before
        (first.mnt / "after").write_bytes(b"after")
        assert (first.mnt / "after").read_bytes() == b"after"
        assert (first.mnt / "before").read_bytes() == b"before"
        assert c.head() == "n1"
        st = first.status()["cluster"]
        assert [(n["id"], n["alive"]) for n in st["nodes"]] == [("n1", True)]
        first.flush(timeout=60)
        assert c.ufs_files() == {"before": b"before", "after": b"after"}


def test_restart_after_kill9_while_the_old_lease_lives(tmp_path, etcd1):
    """A node killed -9 restarts under its own id while its old registration still looks
    alive (the test keeps the dead process's lease alive, as etcd does for up to the TTL):
    on the same address (the restarted node answers there itself) and on another one (nothing
    answers at the old address), it joins, becomes head again and its mount works."""
    from acache.meta.etcd import EtcdClient
    from tests.cluster_local import free_port
    with LocalCluster(tmp_path, etcd1, 1, flush_delay=600) as c:
        node = c.nodes[0]
        assert c.wait_head() == "n1"
        e = EtcdClient.from_url(c.url)
        try:
            for i, new_port in enumerate((False, True)):
                data = os.urandom(100_000 + i)
                (node.mnt / f"f{i}").write_bytes(data)
                old = e.get(e.prefix + b"members/alive/n1")
                ka = e.keepalive(old.lease, 3.0)
                try:
                    node.kill9()
                    assert e.get(e.prefix + b"members/alive/n1") == old   # still "alive"
                    if new_port:
                        cfg = node.home / "config.toml"
                        cfg.write_text("\n".join(
                            f'listen = "127.0.0.1:{free_port()}"' if ln.startswith("listen")
                            else ln for ln in cfg.read_text().splitlines()) + "\n")
                    node.restart()
                finally:
                    ka.stop()
                now = e.get(e.prefix + b"members/alive/n1")
                assert now is not None and now.lease != old.lease
                assert c.wait_head() == "n1"
                assert (node.mnt / f"f{i}").read_bytes() == data
                (node.mnt / f"g{i}").write_bytes(b"after restart")
                assert "taken as this node's own" in node.log_tail(400)
            node.flush(timeout=60)
            assert sorted(c.ufs_files()) == ["f0", "f1", "g0", "g1"]
        finally:
            e.close()


def test_closes_together_on_two_nodes_overlap_and_markers_still_follow(tmp_path, etcd1, engine):
    """A checkpoint step across hosts: a rank on A and one on B close their shards at one
    moment (a barrier), and once both closes returned a marker is written (on A or B in
    turn).  Each node tells the head when its engine read the FLUSH (a Began notice), so the
    head numbers the close by that, not by when the close itself arrived: the member's
    close counts as overlapping the head's own (status: began_used per node) -- and over many
    rounds the under-storage never shows a step's marker before both of its shards."""
    with LocalCluster(tmp_path, etcd1, 2, engine=engine, flush_delay=0.0) as c:
        a, b = c.nodes
        head_id = c.wait_head()
        member = b if head_id == a.root.name else a
        seen_bad: list[str] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                names = set(os.listdir(c.ufs_dir))
                for n in names:
                    if n.startswith("marker-") and not {f"a-{n[7:]}", f"b-{n[7:]}"} <= names:
                        seen_bad.append(n)
        t = threading.Thread(target=watch)
        t.start()
        rounds = 30
        try:
            for i in range(rounds):
                barrier = threading.Barrier(2)
                errors: list[BaseException] = []

                def rank(node, name: str, i: int = i, barrier=barrier, errors=errors) -> None:
                    try:
                        with open(node.mnt / name, "wb") as f:
                            f.write(os.urandom(4096 + i))
                            barrier.wait(10)     # then both close at once
                    except BaseException as e:   # noqa: BLE001 -- reported below
                        errors.append(e)
                ts = [threading.Thread(target=rank, args=(n, f"{tag}-{i}"))
                      for n, tag in ((a, "a"), (b, "b"))]
                for th in ts:
                    th.start()
                for th in ts:
                    th.join()
                assert not errors, errors
                ((a, b)[i % 2].mnt / f"marker-{i}").write_bytes(b"done")
        finally:
            b.flush()
            stop.set()
            t.join()
        assert not seen_bad, f"markers landed before their shards: {sorted(set(seen_bad))[:5]}"
        files = c.ufs_files()
        assert sum(1 for k in files if k.startswith("marker-")) == rounds
        assert sum(1 for k in files if k[:2] in ("a-", "b-")) == 2 * rounds
        used = b.status()["cluster"].get("began_used") or {}
        assert used.get(member.root.name, 0) > 0, \
            f"no close of the member was numbered by its notice: {used}"
