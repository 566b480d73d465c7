"""Cluster members on loopback for tests: one etcd (the session's ``etcd1``), N real nodes
(the `acache` CLI, a FUSE mount each), one shared file:// under-storage.

    with LocalCluster(tmp_path, etcd1, n=2) as c:
        a, b = c.nodes                   # tests.acache_node.AcacheNode, started and mounted
        c.head()                         # the node id holding the head role (from etcd)

Node i is ``n<i>`` listening on a free loopback port (loopback: no secret needed).
``cacheless=k``: the last k nodes have no cache (placement = "hash": their files are placed
on the other nodes, the workers; acache.cluster.cacheless).
"""
from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path

from tests.acache_node import AcacheNode, files_under


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    def __init__(self, root: Path, etcd, n: int = 2, engine: str = "pyfuse3",
                 flush_delay: float = 0.2, extra: str = "", ufs: str | None = None,
                 extra_env: dict | None = None, cacheless: int = 0) -> None:
        self.root = Path(root)
        self.etcd = etcd
        self.name = "c" + uuid.uuid4().hex[:10]
        self.url = etcd.url(self.name)
        self.ufs_dir = self.root / "ufs"
        self.ufs_dir.mkdir(parents=True, exist_ok=True)
        self.ufs = ufs or f"file://{self.ufs_dir}"
        self.nodes: list[AcacheNode] = []
        for i in range(1, n + 1):
            cfg = (f'meta = "{self.url}"\nlisten = "127.0.0.1:{free_port()}"\n'
                   f'node_id = "n{i}"\n{extra}'
                   + ('placement = "hash"\n' if i > n - cacheless else ""))
            self.nodes.append(AcacheNode(self.root / f"n{i}", engine=engine, ufs=self.ufs,
                                         flush_delay=flush_delay, config=cfg, extra_env=extra_env))

    def __enter__(self) -> "LocalCluster":
        try:
            for node in self.nodes:
                node.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for node in self.nodes:
            node.stop()

    def node(self, node_id: str) -> AcacheNode:
        return self.nodes[int(node_id[1:]) - 1]

    def head(self) -> str | None:
        from acache.meta.etcd import EtcdClient
        c = EtcdClient.from_url(self.url)
        try:
            kv = c.get(c.prefix + b"head")
            return kv.value.decode() if kv is not None else None
        finally:
            c.close()

    def wait_head(self, not_: str | None = None, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            h = self.head()
            if h is not None and h != not_:
                return h
            time.sleep(0.1)
        raise AssertionError(f"no head other than {not_} within {timeout} s")

    def ufs_files(self) -> dict[str, bytes]:
        return files_under(self.ufs_dir)
