"""A cluster of workers and cacheless clients on netns hosts (tests.cluster_hosts), for the
cacheless tests and scripts/bench_workers.

    with Hosts(5) as hosts:
        etcd = hosts.etcd(tmp / "etcd", on=[0])
        c = HostCluster(hosts, tmp, etcd, workers=[1, 2, 3], clients=[4])
        c.start()                          # workers first (one becomes the head), then clients
        c.workers, c.clients               # ClusterNode lists: node ids w<host>, c<host>
        c.head()                           # the head's node id (from etcd)
        c.add_worker(5)                    # one more worker, started

Every node listens on ADDR:7470 of its host with a shared cluster secret; the under-storage
is one shared file:// directory (tmp/ufs).
"""
from __future__ import annotations

import uuid
from pathlib import Path

from tests.cluster_hosts import ClusterNode, Hosts, write_secret


class HostCluster:
    def __init__(self, hosts: Hosts, root: Path, etcd, workers: list[int], clients: list[int], *,
                 flush_delay: float = 0.2, engine: str = "pyfuse3", extra: dict | None = None) -> None:
        self.hosts, self.root, self.etcd = hosts, Path(root), etcd
        self.name = "c" + uuid.uuid4().hex[:10]
        self.url = etcd.url(self.name)
        self.ufs_dir = self.root / "ufs"
        self.ufs_dir.mkdir(parents=True, exist_ok=True)
        self.secret = write_secret(self.root / "secret")
        self.flush_delay, self.engine, self.extra = flush_delay, engine, dict(extra or {})
        self.workers = [self._node(h, "w") for h in workers]
        self.clients = [self._node(h, "c") for h in clients]

    def _node(self, host: int, kind: str) -> ClusterNode:
        addr = self.hosts.addr(host)
        cfg = {"meta": self.url, "listen": f"{addr}:7470", "advertise": f"{addr}:7470",
               "secret_file": self.secret, "node_id": f"{kind}{host}", **self.extra}
        if kind == "c":
            cfg["placement"] = "hash"
        return ClusterNode(self.hosts, host, self.root / f"{kind}{host}", f"file://{self.ufs_dir}",
                           config=cfg, flush_delay=self.flush_delay, engine=self.engine)

    def start(self) -> "HostCluster":
        for n in self.workers + self.clients:
            n.start()
        return self

    def add_worker(self, host: int) -> ClusterNode:
        n = self._node(host, "w")
        self.workers.append(n)
        return n.start()

    def node(self, node_id: str) -> ClusterNode:
        return next(n for n in self.workers + self.clients if n.root.name == node_id)

    def head(self) -> str | None:
        """The head's id, as a node reports it (etcd is not reachable from outside the hosts)."""
        for n in self.workers + self.clients:
            if not n.stopped and n.pid():
                return n.status()["cluster"].get("head")
        return None

    def status(self, path: str | None = None) -> dict:
        """The cluster part of a live node's ``status --json`` (``files`` with a holder each
        when ``path`` is given: a path on that node's mount)."""
        n = next(n for n in self.clients + self.workers if not n.stopped and n.pid())
        return n.status(path)["cluster"]

    def stop(self) -> None:
        for n in self.clients + self.workers:
            n.stop()


def cache_files(node) -> dict[int, int]:
    """ino -> size of the cache files in a node's cache directory (``<ino hex>.<gen>``)."""
    import re
    out = {}
    d = node.home / "cache" / "data"
    if not d.exists():
        return out
    for p in d.iterdir():
        m = re.fullmatch(r"([0-9a-f]+)\.(\d+)", p.name)
        if m and p.is_file():
            out[int(m.group(1), 16)] = p.stat().st_size
    return out
