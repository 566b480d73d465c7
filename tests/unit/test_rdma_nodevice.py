"""A host without an RDMA device (the normal host suite: no marker): ``transport = auto``
gives TCP with the reason on the connection, without importing pyverbs; ``transport = rdma``
refuses to start with one line."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from acache import config
from acache.errors import ConfigError
from acache.net import rdma, transport_from_settings
from acache.net.rdma import RdmaTransport

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

AUTO = r"""
import os, sys
import acache.net.rdma as rdma
rdma.SYSFS = sys.argv[1]           # no device, whatever this host has
from acache.net.rdma import RdmaTransport
from tests.net_peer import FileServer
assert "pyverbs" not in sys.modules
t = RdmaTransport(None, mode="auto", timeout=5)
lst = t.listen("127.0.0.1:0")
FileServer(sys.argv[2]).register(lst)
lst.start()
c = RdmaTransport(None, mode="auto", timeout=5).connect(lst.address)
buf = bytearray(1 << 20)
n = c.read_into("read", {"name": "f", "offset": 0, "length": len(buf)}, memoryview(buf))
with open(os.path.join(sys.argv[2], "f"), "rb") as f:
    assert buf[:n] == f.read()
print(c.path, "|", c.stats()["transport"], "|", lst.capabilities["rdma_off"], "|",
      "pyverbs" in sys.modules, "|", sorted(m for m in sys.modules if "verbs" in m))
c.close()
lst.close()
"""


def test_auto_without_device_is_tcp_and_never_imports_pyverbs(tmp_path):
    (tmp_path / "f").write_bytes(os.urandom(1 << 20))
    r = subprocess.run([sys.executable, "-c", AUTO, str(tmp_path / "no-sysfs"), str(tmp_path)],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    path, kind, off, imported, mods = (x.strip() for x in r.stdout.strip().split("|"))
    assert path == "tcp: no RDMA device on this host" and kind == "tcp"
    assert off == "no RDMA device on this host"
    assert imported == "False" and mods == "[]"


def test_rdma_without_device_refuses_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(rdma, "SYSFS", str(tmp_path / "no-sysfs"))
    with pytest.raises(ConfigError) as e:
        RdmaTransport(None, mode="rdma")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("transport = rdma: no RDMA device on this host")
    assert "set transport = auto or tcp" in msg
    s = config.load(home=str(tmp_path), transport="rdma")
    with pytest.raises(ConfigError) as e:
        transport_from_settings(s)
    assert "\n" not in str(e.value) and str(e.value).endswith("(--transport)")
    # auto and tcp start
    assert transport_from_settings(config.load(home=str(tmp_path))).mode == "auto"
    assert transport_from_settings(config.load(home=str(tmp_path), transport="tcp")).mode == "tcp"


def test_transport_key_is_validated(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('transport = "infiniband"\n')
    with pytest.raises(ConfigError, match=r"line 1: transport = 'infiniband': expected one of auto, tcp, rdma"):
        config.load(cfg, home=str(tmp_path))


def test_tcp_mode_advertises_why(tmp_path):
    t = RdmaTransport(None, mode="tcp")
    assert t.capabilities["rdma_off"] == "transport = tcp" and "rdma" not in t.capabilities


def test_serving_slot_leases():
    """The serving pool's bookkeeping: a slot is never free while it is being written, even
    when its session closes meanwhile; leases are handed back by id, by their own session only;
    expired ones are taken back when slots run short."""
    from acache.net.rdma import _Leases
    p = _Leases(3, 4096)
    a = p.take(b"A", 2, lease=30)
    assert a is not None and sorted(off for _, off in a) == [4096, 8192]   # slots 1 and 2
    assert p.take(b"B", 2, lease=30) is None                # one free
    p.give_all(b"A")                                        # A closed while its reply is written
    assert p.take(b"B", 2, lease=30) is None                # ... so nothing came free yet
    p.filled([lid for lid, _ in a])                         # written: now the slots are free
    b = p.take(b"B", 3, lease=30)
    assert b is not None and len({off for _, off in b}) == 3
    p.filled([lid for lid, _ in b])
    p.give(b"A", [lid for lid, _ in b])                     # not A's to give
    assert p.take(b"C", 1, lease=30) is None
    p.give(b"B", [b[0][0], 999, "x"])                       # unknown ids are ignored
    c = p.take(b"C", 1, lease=-1)                           # leased already expired
    assert c is not None
    p.filled([c[0][0]])
    assert p.take(b"D", 1, lease=30) is not None            # the expired lease was taken back


def test_up_with_transport_rdma_refuses_without_a_device(tmp_path):
    """`acache up` with transport = rdma on a host without a device: one line, exit 1, no node."""
    assert not rdma.local_devices(), "this test is for a host without RDMA devices"
    env = dict(os.environ, ACACHE_HOME=str(tmp_path / "home"), ACACHE_TRANSPORT="rdma")
    p = subprocess.run([sys.executable, "-m", "acache.cli", "up"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1, p
    assert "transport = rdma (environment ACACHE_TRANSPORT): no RDMA device" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "home" / "acache.sock").exists()
