"""Real etcd members for the tests: free loopback ports, a temp data dir each, killed at the end.

Fixtures (pytest plugin, loaded by tests/conftest.py):
    etcd1          a one-member cluster for the session (tests isolate by a unique NAME)
    etcd3          a fresh three-member cluster per test (failover tests kill members)
    etcd_name      a unique cluster name (key prefix) for one test

Members can live in network namespaces (tests/cluster_hosts.Hosts.etcd): ``where`` gives each
member a host address and the namespace path it runs in (via nsenter); its ports are then
2379/2380 on that address, and its health is probed from inside that namespace.

Without /usr/bin/etcd (Debian: etcd-server) the tests skip with the reason; with
ACACHE_TEST_REQUIRE_ALL=1 they fail instead.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

REQUIRE_ALL = os.environ.get("ACACHE_TEST_REQUIRE_ALL", "0") == "1"
ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def need_etcd() -> str:
    if ETCD is None:
        msg = "etcd is not installed (Debian package etcd-server; scripts/install installs it)"
        if REQUIRE_ALL:
            print(f"\nERROR: {msg}, and ACACHE_TEST_REQUIRE_ALL=1")
            pytest.fail(msg + " and ACACHE_TEST_REQUIRE_ALL=1", pytrace=False)
        pytest.skip(msg)
    return ETCD


class Member:
    def __init__(self, name: str, root: Path, host: str = "127.0.0.1",
                 netns: str | None = None) -> None:
        self.name = name
        self.dir = root / name
        self.host = host
        self.netns = netns         # e.g. /run/netns/NAME: the member runs (and is probed) there
        # a namespace has ports of its own; on the shared loopback, take free ones
        self.client_port = 2379 if netns else _free_port()
        self.peer_port = 2380 if netns else _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def healthy(self) -> bool:
        def probe() -> bool:
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                    return b'"health":"true"' in r.read()
            except OSError:
                return False
        if self.netns is None:
            return probe()
        from tests.netns import run_in_netns
        return run_in_netns(self.netns, probe, timeout=10)


class EtcdCluster:
    def __init__(self, root: Path, n: int = 1,
                 where: list[tuple[str, str]] | None = None) -> None:
        """``where``: (host address, netns path) of each member; None: all on 127.0.0.1."""
        self.etcd = need_etcd()
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        assert where is None or len(where) == n, "one (address, netns) per member"
        self.members = [Member(f"m{i}", root, *(where[i] if where else ()))
                        for i in range(n)]
        self.token = uuid.uuid4().hex[:12]

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def url(self, name: str, **opts) -> str:
        q = "&".join(f"{k}={v}" for k, v in opts.items())
        return f"etcd://{','.join(self.endpoints)}/{name}" + (f"?{q}" if q else "")

    def member(self, endpoint: str) -> Member:
        return next(m for m in self.members if m.endpoint == endpoint)

    def start(self, member: Member | None = None, wait: bool = True) -> None:
        todo = [member] if member else self.members
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in todo:
            assert m.proc is None or m.proc.poll() is not None, f"{m.name} is running"
            log = open(self.root / f"{m.name}.log", "ab")
            enter = ["nsenter", f"--net={m.netns}", "--"] if m.netns else []
            m.proc = subprocess.Popen(
                [*enter, self.etcd, "--name", m.name, "--data-dir", str(m.dir),
                 "--listen-client-urls", f"http://{m.endpoint}",
                 "--advertise-client-urls", f"http://{m.endpoint}",
                 "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
                 "--initial-cluster", initial, "--initial-cluster-state", "new",
                 "--initial-cluster-token", self.token, "--log-level", "warn",
                 "--logger", "zap"],
                stdout=log, stderr=log, start_new_session=True)
            log.close()
        if wait:
            self.wait_healthy(todo)

    def wait_healthy(self, members: list[Member] | None = None, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for m in members or self.members:
            while True:
                if m.proc is not None and m.proc.poll() is not None:
                    raise RuntimeError(f"etcd {m.name} exited {m.proc.returncode}: "
                                       f"{(self.root / (m.name + '.log')).read_text()[-2000:]}")
                if m.healthy():
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd {m.name} not healthy after {timeout}s")
                time.sleep(0.05)

    def kill(self, member: Member) -> None:
        """kill -9, and reap it."""
        if member.proc is not None and member.proc.poll() is None:
            os.kill(member.proc.pid, signal.SIGKILL)
            member.proc.wait(10)

    def leader(self) -> Member:
        """The raft leader, asked from this process: loopback members only (for members in
        namespaces, ask from inside a host: tests/cluster/etcd_probe.py)."""
        assert not any(m.netns for m in self.members), "leader(): members live in namespaces"
        from acache.meta.etcd import EtcdClient
        c = EtcdClient(self.endpoints)
        try:
            for m in self.members:
                if m.proc is None or m.proc.poll() is not None:
                    continue
                try:
                    st = c.status(m.endpoint)
                except Exception:
                    continue
                if st.leader and st.leader == st.header.member_id:
                    return m
        finally:
            c.close()
        raise RuntimeError("no leader")

    def stop(self) -> None:
        for m in self.members:
            self.kill(m)


@pytest.fixture(scope="session")
def etcd1(tmp_path_factory):
    c = EtcdCluster(tmp_path_factory.mktemp("etcd1"), 1)
    c.start()
    yield c
    c.stop()


@pytest.fixture
def etcd3(tmp_path):
    c = EtcdCluster(tmp_path / "etcd3", 3)
    c.start()
    yield c
    c.stop()


@pytest.fixture
def etcd_name() -> str:
    return "t" + uuid.uuid4().hex[:12]
