"""The multi-host harness itself (tests/cluster_hosts.py), on what exists today: hosts reach
each other and only each other, a cut link is a silent one and comes back, shaping holds,
etcd members inside hosts serve other hosts and survive kill -9 of one of three, and acache
nodes started inside hosts mount and serve files the test sees."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from tests.acache_node import fuse_mounts
from tests.cluster_hosts import ClusterNode, Hosts, _netns_names, need_hosts, write_secret
from tests.etcd.helpers import wait_for
from tests.etcd_server import need_etcd

ECHO = """
import socket, sys, threading
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("READY", flush=True)
def serve(c):                 # all of it, then all of it back: no deadlock on big payloads
    with c:
        got = []
        while (b := c.recv(1 << 16)):
            got.append(b)
        c.sendall(b"".join(got))
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""


@pytest.fixture(autouse=True)
def _needs():
    need_hosts()


def echo_server(hosts: Hosts, host: int, port: int = 7000) -> subprocess.Popen:
    p = hosts.spawn(host, [sys.executable, "-c", ECHO, hosts.addr(host), str(port)],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = p.stdout.readline()
    assert line.strip() == "READY", f"echo server on host {host}: {line!r} {p.stderr.read()}"
    return p


def echo(addr: str, port: int = 7000, payload: bytes = b"ping", timeout: float = 5) -> bytes:
    with socket.create_connection((addr, port), timeout=timeout) as c:
        c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        got = b""
        while (b := c.recv(1 << 16)):
            got += b
        return got


def root_links() -> list[str]:
    r = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True)
    return sorted(ln.split(":")[1].strip() for ln in r.stdout.splitlines())


def test_hosts_reach_each_other_and_clean_up():
    """Every host reaches every other (a TCP echo, server spawned in one host, client on a
    thread in another); the root namespace gets no interface; nothing is left afterwards,
    and a dead run's namespaces of the same prefix are reaped on entering."""
    before = root_links()
    with Hosts(3, tag="th") as hosts:
        for j in range(3):
            echo_server(hosts, j)
        for i in range(3):
            for j in range(3):
                msg = f"{i}->{j}".encode()
                assert hosts.run_in(i, echo, hosts.addr(j), 7000, msg) == msg
        assert root_links() == before, "the root namespace's links changed"
        names = list(hosts.names) + [hosts.hub]
    left = [ns for ns in _netns_names() if ns in names]
    assert not left and root_links() == before

    # a namespace of a run that died (pid 2**22 + 1 is above pid_max's default: never alive)
    stale = "ach-th-4194305-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    with Hosts(1, tag="th"):
        assert stale not in _netns_names()


def test_link_down_is_silent_and_link_up_restores():
    with Hosts(2, tag="tl") as hosts:
        echo_server(hosts, 1)
        assert hosts.run_in(0, echo, hosts.addr(1)) == b"ping"
        hosts.link_down(1)
        t = time.monotonic()
        with pytest.raises(OSError) as e:        # socket.timeout is an OSError
            hosts.run_in(0, echo, hosts.addr(1), 7000, b"x", 1.0)
        # no answer at all (a pulled cable), not a refusal or an unreachable network
        assert isinstance(e.value, TimeoutError), repr(e.value)
        assert time.monotonic() - t >= 0.9
        with pytest.raises(TimeoutError):      # nor can the cut host reach out
            hosts.run_in(1, echo, hosts.addr(0), 7000, b"x", 1.0)
        hosts.link_up(1)
        assert hosts.run_in(0, echo, hosts.addr(1)) == b"ping"


def test_rate_shapes_the_link():
    """10 MB into a host shaped to 100 mbit and back out takes at least ~1.7 s (asserted:
    1.2 s, a lower bound only: nothing depends on the machine being fast); unshaped again,
    no tbf is left."""
    with Hosts(2, tag="tr") as hosts:
        echo_server(hosts, 1)
        hosts.rate(1, "100mbit")
        qd = hosts.run(1, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
        assert "tbf" in qd and "100Mbit" in qd, qd
        data = os.urandom(10 << 20)
        t = time.monotonic()
        assert hosts.run_in(0, echo, hosts.addr(1), 7000, data, 30) == data
        took = time.monotonic() - t
        assert took >= 1.2, f"10 MB both ways over 100 mbit in {took:.2f}s: not shaped"
        hosts.rate(1, None)
        assert "tbf" not in hosts.run(1, ["tc", "qdisc", "show", "dev", "eth0"]).stdout


def probe(hosts: Hosts, host: int, endpoints: list[str]) -> tuple[subprocess.Popen, dict]:
    p = hosts.spawn(host, [sys.executable, "-m", "tests.cluster.etcd_probe",
                           f"/t/{uuid.uuid4().hex[:8]}/", ",".join(endpoints)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = p.stdout.readline()
    assert line.startswith("READY "), f"etcd probe: {line!r} {p.stderr.read()[-3000:]}"
    return p, json.loads(line.split(" ", 1)[1])


def probe_put(p: subprocess.Popen, n: int) -> dict:
    p.stdin.write(f"put {n}\n")
    p.stdin.flush()
    line = p.stdout.readline()
    assert line.startswith("OK "), f"etcd probe: {line!r}"
    return json.loads(line.split(" ", 1)[1])


def test_etcd_member_in_one_host_serves_another(tmp_path):
    need_etcd()
    with Hosts(2, tag="te") as hosts:
        etcd = hosts.etcd(tmp_path / "etcd", on=[0])
        assert etcd.endpoints == [f"{hosts.addr(0)}:2379"]
        p, info = probe(hosts, 1, etcd.endpoints)
        assert info["leader"] == etcd.endpoints[0]
        assert probe_put(p, 20)["keys"] == 20
        p.stdin.close()
        assert p.wait(20) == 0, p.stderr.read()


def test_etcd_three_members_survive_kill9_of_the_leader(tmp_path):
    """Members on hosts 0-2, acache's client on host 3: kill -9 the raft leader between two
    batches of writes; the same client goes on, every key is there."""
    need_etcd()
    with Hosts(4, tag="t3") as hosts:
        etcd = hosts.etcd(tmp_path / "etcd", on=[0, 1, 2])
        p, info = probe(hosts, 3, etcd.endpoints)
        assert info["leader"] in etcd.endpoints
        assert probe_put(p, 20)["keys"] == 20
        victim = etcd.member(info["leader"])
        etcd.kill(victim)
        t = time.monotonic()
        after = probe_put(p, 20)
        print(f"\nkilled leader {victim.name}; the next 20 writes took {time.monotonic() - t:.2f}s "
              f"(client on {info['current']} -> {after['current']})")
        assert after["keys"] == 40
        p.stdin.close()
        assert p.wait(20) == 0, p.stderr.read()


def _netns_inode(path: str) -> int:
    return os.stat(path).st_ino


def test_nodes_in_hosts_mount_and_serve(tmp_path):
    """Two single-host nodes (no meta key; node 0 on pyfuse3, node 1 on the native engine),
    each started in its own host over one shared under-storage directory: each daemon lives
    in its host's network namespace and the test's mount namespace, each mount shows in the
    test's mount table, files written through a mount read back, flush lands them; kill -9
    of node 1 with its file not yet persisted, restart, flush: it lands."""
    need_hosts(fuse=True)
    shared = tmp_path / "shared"
    shared.mkdir()
    secret = write_secret(tmp_path / "secret")
    with Hosts(2, tag="tn") as hosts:
        nodes = [ClusterNode(hosts, i, tmp_path / f"n{i}", f"file://{shared}", flush_delay=30,
                             engine=("pyfuse3", "native")[i],
                             config={"listen": f"{hosts.addr(i)}:7470", "advertise":
                                     f"{hosts.addr(i)}:7470", "secret_file": secret})
                 for i in range(2)]
        for n in nodes:
            n.start()
        for i, n in enumerate(nodes):
            assert str(n.mnt) in fuse_mounts(), f"node {i}'s mount is not visible to the test"
            pid = n.pid()
            assert _netns_inode(f"/proc/{pid}/ns/net") == _netns_inode(hosts.netns(i))
            assert _netns_inode(f"/proc/{pid}/ns/mnt") == _netns_inode("/proc/self/ns/mnt")
        for i, n in enumerate(nodes):
            (n.mnt / f"from{i}.bin").write_bytes(b"%d" % i * 100_000)
        for i, n in enumerate(nodes):
            assert (n.mnt / f"from{i}.bin").read_bytes() == b"%d" % i * 100_000
        a = nodes[0]
        a.flush()
        assert (shared / "from0.bin").read_bytes() == b"0" * 100_000
        assert not (shared / "from1.bin").exists()      # flush_delay 30: node 1's still cached
        b = nodes[1]
        b.kill9()
        b.restart()
        b.flush()
        assert (shared / "from1.bin").read_bytes() == b"1" * 100_000
        for n in nodes:
            n.stop()
            assert str(n.mnt) not in fuse_mounts()
        wait_for(lambda: not subprocess.run(["ip", "netns", "pids", hosts.names[0]],
                                            capture_output=True, text=True).stdout.strip(),
                 10, "nothing left running in host 0")
