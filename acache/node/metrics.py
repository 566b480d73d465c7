"""Prometheus metrics of the node: ``metrics = "127.0.0.1:9567"`` serves /metrics.

One custom collector reads the node's current state at scrape time (nothing is counted
on the hot path for it, except the FUSE request histogram, acache.fs.opstats, and a few
integer increments where something happens rarely: an eviction, an upload error, a stall).

Every metric of this node is unlabelled or labelled by what it counts (``kind``, ``op``);
Prometheus adds ``instance``.  On a cluster member (acache.cluster) the persist-queue and
upload series are the cluster's, as the head reports them (one request to it per scrape;
left out while no head answers), and these are added:

    acache_peer_sent_bytes_total{peer,transport}      bytes sent to a peer (tcp | rdma)
    acache_peer_received_bytes_total{peer,transport}
    acache_peer_up{peer,transport}                    1 while the peer's alive key exists
    acache_cluster_nodes{state}                       nodes alive / down, as etcd has them
    acache_cluster_persist_blocked{node}              1 for the node whose data holds back the
                                                      ordered persistence of the others
    acache_cluster_head                               1 on the node that is the head now
"""
from __future__ import annotations

import logging
import socket
from typing import Iterator

from prometheus_client.core import (CollectorRegistry, CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.exposition import start_http_server

from acache import __version__
from acache.config import split_hostport
from acache.errors import ConfigError
from acache.fs.opstats import BOUNDS

log = logging.getLogger("acache.metrics")

# name, type, help: the list docs/operations.md shows
METRICS = [
    ("acache_node_info", "gauge", "1, labelled with the node's version, engine and under-storage"),
    ("acache_dirty_bytes", "gauge", "bytes in the cache not yet in the under-storage"),
    ("acache_dirty_files", "gauge", "cache files not yet in the under-storage"),
    ("acache_persisting_bytes", "gauge", "bytes of the files being uploaded now"),
    ("acache_persisting_files", "gauge", "files being uploaded now"),
    ("acache_persisted_bytes_total", "counter", "bytes of files committed to the under-storage"),
    ("acache_persisted_files_total", "counter", "files committed to the under-storage"),
    ("acache_persist_queue_entries", "gauge", "journal entries not yet applied"),
    ("acache_persist_queue_bytes", "gauge", "bytes of the files in the persist queue"),
    ("acache_persist_queue_oldest_age_seconds", "gauge", "age of the oldest pending entry"),
    ("acache_persist_failed_entries", "gauge", "entries failing permanently (retried slowly)"),
    ("acache_upload_bytes_total", "counter", "bytes sent to the under-storage (parts, puts, copies)"),
    ("acache_upload_rate_bytes_per_second", "gauge", "persisted bytes per second, last 10 s"),
    ("acache_upload_errors_total", "counter", "failed upload attempts by kind (transient, permanent)"),
    ("acache_upload_limit_bytes_per_second", "gauge", "upload_limit in force (0: no limit)"),
    ("acache_upload_throttled_seconds_total", "counter", "time uploads waited for the upload_limit"),
    ("acache_writer_stalls_total", "counter", "writes that waited for room (dirty data filled the cache)"),
    ("acache_writer_stall_seconds_total", "counter", "time writers waited for room (backpressure)"),
    ("acache_enospc_total", "counter", "writes answered ENOSPC after stall_timeout"),
    ("acache_cache_used_bytes", "gauge", "bytes in the cache (clean and dirty)"),
    ("acache_cache_limit_bytes", "gauge", "the cache limit in force"),
    ("acache_cache_evictions_total", "counter", "clean files evicted to make room"),
    ("acache_cache_evicted_bytes_total", "counter", "bytes of the evicted files"),
    ("acache_readthrough_hits_total", "counter", "chunks of partly cached files read from the cache"),
    ("acache_readthrough_misses_total", "counter", "chunks that had to be fetched from the under-storage"),
    ("acache_ufs_read_bytes_total", "counter", "bytes fetched from the under-storage (read-through)"),
    ("acache_ufs_reads_total", "counter", "read requests made to the under-storage"),
    ("acache_fuse_requests_total", "counter", "FUSE requests by op"),
    ("acache_peer_sent_bytes_total", "counter", "cluster: bytes sent to a peer, by peer and transport"),
    ("acache_peer_received_bytes_total", "counter", "cluster: bytes received from a peer"),
    ("acache_peer_up", "gauge", "cluster: 1 while the peer is alive (its etcd lease holds)"),
    ("acache_cluster_nodes", "gauge", "cluster: nodes by state (alive, down)"),
    ("acache_cluster_persist_blocked", "gauge", "cluster: 1 for the down node whose data holds back persisting"),
    ("acache_cluster_head", "gauge", "cluster: 1 on the node that runs the namespace now"),
    ("acache_fuse_request_duration_seconds", "histogram", "FUSE request latency by op"),
]


class NodeCollector:
    def __init__(self, node) -> None:
        self.node = node

    def describe(self):
        return []       # no up-front description: collect() is only called at scrape time

    def collect(self) -> Iterator:
        n = self.node
        info = GaugeMetricFamily("acache_node_info", METRICS[0][2],
                                 labels=["version", "engine", "ufs_scheme", "host"])
        info.add_metric([__version__, n.engine_name or "none", n.settings.ufs_url.partition(":")[0],
                         socket.gethostname()], 1)
        yield info
        dirty_bytes, dirty_files = n.cache.dirty_stats()
        yield g("acache_dirty_bytes", dirty_bytes)
        yield g("acache_dirty_files", dirty_files)
        if n.member is not None:
            yield from self._member(n)
            return
        c, p, fetch = n.cache, n.persister, n.vfs.fetch
        q = p.queue_stats()
        with n.meta.lock:
            journal = n.meta.journal()
        yield g("acache_persisting_bytes", q["persisting_bytes"])
        yield g("acache_persisting_files", q["persisting_files"])
        yield ctr("acache_persisted_bytes_total", q["persisted_bytes"])
        yield ctr("acache_persisted_files_total", q["persisted_files"])
        yield g("acache_persist_queue_entries", len(journal))
        yield g("acache_persist_queue_bytes", sum(e.size for e in journal))
        yield g("acache_persist_queue_oldest_age_seconds", q["oldest_age"])
        yield g("acache_persist_failed_entries", q["failed"])
        yield ctr("acache_upload_bytes_total", n.limiter.taken)
        yield g("acache_upload_rate_bytes_per_second", p.rate())
        errs = CounterMetricFamily("acache_upload_errors", _HELP["acache_upload_errors_total"],
                                   labels=["kind"])
        for kind in ("transient", "permanent"):
            errs.add_metric([kind], q["errors"].get(kind, 0))
        yield errs
        yield g("acache_upload_limit_bytes_per_second", n.limiter.rate() or 0)
        yield ctr("acache_upload_throttled_seconds_total", n.limiter.waited)
        yield from _cache_series(c, fetch)
        yield from self._fuse()

    def _member(self, n) -> Iterator:
        """A cluster member: its cache and mount as above; the queue is the head's."""
        from acache.cluster.schema import Status
        from acache.errors import AcacheError
        c, fetch, m = n.cache, n.vfs.fetch, n.member
        try:
            h = m.call(Status())
        except AcacheError:
            h = None
        if h is not None:
            yield ctr("acache_persisted_bytes_total", h["persisted_bytes"])
            yield ctr("acache_persisted_files_total", h["persisted_files"])
            yield g("acache_persist_queue_entries", h["queue"])
            yield g("acache_persist_queue_bytes", h["queue_bytes"])
            yield g("acache_persist_failed_entries", h["failed"])
            yield g("acache_upload_rate_bytes_per_second", h["rate"])
        yield g("acache_cluster_head", 1 if m.head is not None else 0)
        yield ctr("acache_upload_bytes_total", n.limiter.taken)
        yield g("acache_upload_limit_bytes_per_second", n.limiter.rate() or 0)
        yield from _cache_series(c, fetch)
        try:
            peers = m.peers()
        except AcacheError:
            peers = []
        nodes = GaugeMetricFamily("acache_cluster_nodes", _HELP["acache_cluster_nodes"],
                                  labels=["state"])
        for state in ("alive", "down"):
            nodes.add_metric([state], sum(1 for p in peers if p["alive"] == (state == "alive")))
        yield nodes
        blocked = GaugeMetricFamily("acache_cluster_persist_blocked",
                                    _HELP["acache_cluster_persist_blocked"], labels=["node"])
        if h is not None and h.get("blocked_by"):
            blocked.add_metric([h["blocked_by"]], 1)
        yield blocked
        sent = CounterMetricFamily("acache_peer_sent_bytes", _HELP["acache_peer_sent_bytes_total"],
                                   labels=["peer", "transport"])
        recv = CounterMetricFamily("acache_peer_received_bytes",
                                   _HELP["acache_peer_received_bytes_total"], labels=["peer", "transport"])
        up = GaugeMetricFamily("acache_peer_up", _HELP["acache_peer_up"], labels=["peer", "transport"])
        conns = dict(m._conns)
        for p in peers:
            if p["id"] == m.node_id:
                continue
            conn = conns.get(p["id"])
            st = conn.stats() if conn is not None else {}
            tr = "rdma" if st.get("path") == "rdma" else "tcp"
            sent.add_metric([p["id"], tr], st.get("bytes_out", 0))
            recv.add_metric([p["id"], tr], st.get("bytes_in", 0))
            up.add_metric([p["id"], tr], 1 if p["alive"] else 0)
        yield sent
        yield recv
        yield up
        yield from self._fuse()

    def _fuse(self) -> Iterator:
        reqs = CounterMetricFamily("acache_fuse_requests", _HELP["acache_fuse_requests_total"],
                                   labels=["op"])
        hist = HistogramMetricFamily("acache_fuse_request_duration_seconds",
                                     _HELP["acache_fuse_request_duration_seconds"], labels=["op"])
        stats = self.node.op_stats()
        for op, (counts, total_ns) in sorted((stats.snapshot() if stats else {}).items()):
            reqs.add_metric([op], sum(counts))
            cum, buckets = 0, []
            for bound, k in zip([*map(repr, BOUNDS), "+Inf"], counts):
                cum += k
                buckets.append((bound, cum))
            hist.add_metric([op], buckets, total_ns / 1e9)
        yield reqs
        yield hist


_HELP = {name: text for name, _, text in METRICS}


def g(name: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, _HELP[name], value=value)


def ctr(name: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name.removesuffix("_total"), _HELP[name], value=value)


def _cache_series(c, fetch) -> Iterator:
    """The cache's and read-through's series (single-host and cluster members alike)."""
    yield ctr("acache_writer_stalls_total", c.stalls)
    yield ctr("acache_writer_stall_seconds_total", c.stall_seconds)
    yield ctr("acache_enospc_total", c.enospc)
    yield g("acache_cache_used_bytes", c.used())
    yield g("acache_cache_limit_bytes", c.effective_limit())
    yield ctr("acache_cache_evictions_total", c.evictions)
    yield ctr("acache_cache_evicted_bytes_total", c.evicted_bytes)
    yield ctr("acache_readthrough_hits_total", fetch.hits)
    yield ctr("acache_readthrough_misses_total", fetch.misses)
    yield ctr("acache_ufs_read_bytes_total", fetch.bytes_read)
    yield ctr("acache_ufs_reads_total", fetch.requests)


class MetricsServer:
    """The /metrics endpoint of ``address`` (HOST:PORT); ConfigError if it cannot listen."""

    def __init__(self, node, address: str, source: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(NodeCollector(node))
        host, port = split_hostport(address)
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            where = f" ({source})" if source else ""
            raise ConfigError(f"metrics = {address!r}{where}: cannot listen there: "
                              f"{e.strerror or e}") from None
        self.address = address
        log.info("metrics at http://%s/metrics", address)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
