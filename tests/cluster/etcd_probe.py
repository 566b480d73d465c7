"""acache's etcd client inside a host (gRPC opens its sockets on threads of its own, so it
runs in a process started in the host's namespace), driven by lines on stdin:

    python -m tests.cluster.etcd_probe PREFIX EP1,EP2,...
    <- READY {"current": EP, "leader": EP}          (after one put went through)
    -> put N
    <- OK {"keys": total written, "current": EP}     (N more keys written, then all read back)
    -> EOF: exit
"""
from __future__ import annotations

import json
import sys

from acache.meta.etcd import EtcdClient


def leader(c: EtcdClient, endpoints: list[str]) -> str | None:
    for ep in endpoints:
        try:
            st = c.status(ep)
        except Exception:
            continue
        if st.leader and st.leader == st.header.member_id:
            return ep
    return None


def main() -> None:
    prefix, endpoints = sys.argv[1].encode(), sys.argv[2].split(",")
    c = EtcdClient(endpoints, prefix=prefix, stall_timeout=20)
    written = 0
    c.put(prefix + b"hello", b"1")
    print("READY " + json.dumps({"current": c.current_endpoint, "leader": leader(c, endpoints)}),
          flush=True)
    for line in sys.stdin:
        n = int(line.split()[1])
        for i in range(written, written + n):
            c.put(prefix + b"k%06d" % i, b"%d" % i)
        written += n
        got = {kv.key: kv.value for kv in c.range_prefix(prefix + b"k")}
        assert got == {prefix + b"k%06d" % i: b"%d" % i for i in range(written)}, "keys lost"
        print("OK " + json.dumps({"keys": written, "current": c.current_endpoint}), flush=True)
    c.close()


if __name__ == "__main__":
    main()
