"""The TCP peer server against hostile and broken peers: authentication, garbage, slowloris,
and a server that stops mid-reply; the server keeps answering a good client throughout."""
from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import random
import socket
import struct
import threading
import time

import pytest

from acache.net import auth, wire
from acache.net.tcp import TcpTransport
from acache.net.transport import AuthError, PeerUnavailable, ProtocolError, RemoteError, Reply

SECRET = b"the-cluster-secret-0123456789abcdef"
OPTS = dict(timeout=2.0, connect_timeout=2.0, handshake_timeout=1.0, frame_timeout=1.0,
            idle_timeout=3.0, max_conns=48, max_pending=16, workers=4,
            limits=wire.Limits(max_meta=64 << 10, max_payload=16 << 20), payload_budget=64 << 20)


def _server(secret=SECRET, **kw):
    lst = TcpTransport(secret, **{**OPTS, **kw}).listen("127.0.0.1:0")
    lst.register("echo", lambda meta, p: Reply(meta, bytes(p)))
    lst.start()
    return lst


@pytest.fixture
def server():
    made = []

    def make(**kw):
        lst = _server(**kw)
        made.append(lst)
        return lst
    yield make
    for lst in made:
        lst.close()


def _connect(lst) -> socket.socket:
    host, port = auth.parse_address(lst.address)
    s = socket.create_connection((host, port), timeout=5)
    return s


def _closed_by_server(s: socket.socket, within: float) -> bool:
    """True if the server closes ``s`` within ``within`` s (EOF or reset), whatever it sends first."""
    s.settimeout(within)
    end = time.monotonic() + within
    try:
        while time.monotonic() < end:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False


# -- authentication -----------------------------------------------------------------------
def test_wrong_secret_refused_both_directions(server, caplog):
    lst = server()
    # the client finds that the server does not know its secret
    with pytest.raises(AuthError, match="does not know the cluster secret"):
        TcpTransport(b"another-secret-0123456789abcdef", **OPTS).connect(lst.address)
    # a client that ignores that and proves with its wrong secret: the server refuses it
    caplog.set_level(logging.WARNING, "acache.net")
    s = _connect(lst)
    c = wire.encode_meta({"caps": {}, "nonce": os.urandom(32), "auth": True})
    auth._send(s, wire.HELLO, c)
    _, raw = auth._recv(s, wire.HELLO)
    body = wire.decode_map(raw)["body"]
    bad = hmac.new(b"wrong-secret-0123456789", auth.LABEL_CLIENT + c + body, hashlib.sha256).digest()
    auth._send(s, wire.PROOF, wire.encode_meta({"proof": bad}))
    ftype, raw = auth._recv(s, wire.ERROR, wire.READY)
    assert ftype == wire.ERROR and wire.decode_map(raw)["errno"] == 13
    assert _closed_by_server(s, 2)
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and "wrong proof" in refused[0].getMessage()
    # no secret at all, and a secret the other side lacks
    with pytest.raises(AuthError, match="requires the cluster secret"):
        TcpTransport(None, **OPTS).connect(lst.address)
    plain = server(secret=None)
    with pytest.raises(AuthError, match="has no cluster secret"):
        TcpTransport(SECRET, **OPTS).connect(plain.address)
    assert TcpTransport(None, **OPTS).connect(plain.address).request("echo", {"a": 1}) == ({"a": 1}, b"")


def test_a_recorded_proof_cannot_be_replayed(server):
    lst = server()

    def session(proof_for=None):
        s = _connect(lst)
        c = wire.encode_meta({"caps": {}, "nonce": b"n" * 32, "auth": True})   # the same nonce
        auth._send(s, wire.HELLO, c)
        _, raw = auth._recv(s, wire.HELLO)
        body = wire.decode_map(raw)["body"]
        proof = proof_for or hmac.new(SECRET, auth.LABEL_CLIENT + c + body, hashlib.sha256).digest()
        auth._send(s, wire.PROOF, wire.encode_meta({"proof": proof}))
        ftype, _ = auth._recv(s, wire.READY, wire.ERROR)
        s.close()
        return ftype, proof
    ftype, recorded = session()
    assert ftype == wire.READY
    assert session(proof_for=recorded)[0] == wire.ERROR


def test_no_secret_off_loopback_is_refused():
    t = TcpTransport(None, **OPTS)
    with pytest.raises(AuthError, match="not a loopback address"):
        t.listen("0.0.0.0:0")
    with pytest.raises(AuthError, match="not a loopback address"):
        t.connect("192.0.2.1:7470")            # refused before any packet is sent
    with pytest.raises(AuthError):
        t.connect("peer.example:7470")
    assert auth.is_loopback("127.0.0.5:1") and auth.is_loopback("[::1]:1") and auth.is_loopback("localhost:1")


def test_secret_file_permissions(tmp_path):
    p = tmp_path / "s"
    p.write_bytes(SECRET + b"\n")
    os.chmod(p, 0o600)
    assert auth.load_secret(p) == SECRET
    os.chmod(p, 0o604)
    with pytest.raises(AuthError, match="lets others read"):
        auth.load_secret(p)


# -- garbage ------------------------------------------------------------------------------
_HDR = struct.Struct(">4sBBHQIQI")


def _authed(lst) -> socket.socket:
    s = _connect(lst)
    auth.client_handshake(s, SECRET, {})
    return s


def _garbage(kind: str, rng: random.Random) -> tuple[bytes, bool]:
    """Bytes a broken peer sends after the handshake, and whether it then waits (slowloris)."""
    ok = wire.pack_header(wire.REQUEST, 1, 0, 0)
    if kind == "random":
        return rng.randbytes(rng.randint(1, 200)), False
    if kind == "magic":
        return b"HTTP" + ok[4:], False
    if kind == "version":
        return _HDR.pack(wire.MAGIC, 9, wire.REQUEST, 0, 1, 0, 0, 0), False
    if kind == "type":
        return _HDR.pack(wire.MAGIC, 1, 77, 0, 1, 0, 0, 0), False
    if kind == "flags":
        return _HDR.pack(wire.MAGIC, 1, wire.REQUEST, 4, 1, 0, 0, 0), False
    if kind == "huge-meta":
        return wire.pack_header(wire.REQUEST, 1, 1 << 31, 0), False
    if kind == "huge-payload":
        return wire.pack_header(wire.REQUEST, 1, 4, 1 << 50), False
    if kind == "bad-msgpack":
        return wire.pack_header(wire.REQUEST, 1, 8) + b"\xc1" * 8, False
    if kind == "not-a-request":
        m = wire.encode_meta({"op": "echo"})
        return wire.pack_header(wire.REQUEST, 1, len(m)) + m, False
    if kind == "truncated":
        return ok[:rng.randint(1, wire.HEADER - 1)], False      # then close
    if kind == "half-header":
        return ok[:rng.randint(1, wire.HEADER - 1)], True       # then wait
    if kind == "half-payload":
        m = wire.encode_meta(["echo", {}])
        return wire.pack_header(wire.REQUEST, 1, len(m), 8 << 20) + m + b"x" * 1000, True
    raise AssertionError(kind)


KINDS_AFTER = ["random", "magic", "version", "type", "flags", "huge-meta", "huge-payload",
               "bad-msgpack", "not-a-request", "truncated", "half-header", "half-payload"]


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    return 0


def _server_threads() -> int:
    return sum(1 for t in threading.enumerate()
               if t.name.startswith(("acache-peer-conn", "acache-peer-h", "acache-peer-accept")))


@pytest.mark.slow
def test_garbage_from_many_connections_while_a_good_client_is_served(server, caplog):
    caplog.set_level(logging.WARNING, "acache.net")
    lst = server()
    good = TcpTransport(SECRET, **OPTS).connect(lst.address)
    stop = threading.Event()
    good_stats = {"ok": 0, "worst": 0.0}
    good_err: list = []

    def good_client() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            p = os.urandom(i % 5000)
            t0 = time.monotonic()
            try:
                r = good.request("echo", {"i": i}, p)
            except Exception as e:     # reported below
                good_err.append(e)
                return
            good_stats["worst"] = max(good_stats["worst"], time.monotonic() - t0)
            if r != ({"i": i}, p):
                good_err.append(AssertionError(f"wrong reply {i}"))
                return
            good_stats["ok"] += 1
    gt = threading.Thread(target=good_client)
    gt.start()

    rss0, peak_threads, peak_rss = _rss(), 0, 0
    failures: list = []
    held: list[socket.socket] = []
    held_lock = threading.Lock()
    sent = {"frames": 0}

    def hostile(seed: int, rounds: int) -> None:
        rng = random.Random(seed)
        for r in range(rounds):
            kind = KINDS_AFTER[(seed + r) % len(KINDS_AFTER)]
            pre = r % 7 == 0                # now and then: garbage instead of a handshake
            try:
                s = _connect(lst) if pre else _authed(lst)
            except (OSError, PeerUnavailable, ProtocolError):
                continue                    # the server made room by closing us: fine
            data, wait = _garbage(kind, rng)
            try:
                s.sendall(data)
            except OSError:
                s.close()
                continue
            sent["frames"] += 1
            if wait:
                with held_lock:
                    held.append(s)
                    if len(held) > 24:       # keep some hanging, let the server time them out
                        old = held.pop(0)
                        if not _closed_by_server(old, 3):
                            failures.append("a slowloris connection was not closed by the server")
                        old.close()
                continue
            if kind != "truncated" and not _closed_by_server(s, 3):
                failures.append(f"{kind}: the server kept the connection")
            s.close()

    ts = [threading.Thread(target=hostile, args=(i, 260)) for i in range(8)]
    for t in ts:
        t.start()
    while any(t.is_alive() for t in ts):
        peak_threads = max(peak_threads, _server_threads())
        peak_rss = max(peak_rss, _rss())
        ts[0].join(0.05)
    for t in ts:
        t.join()
    stop.set()
    gt.join(10)
    for s in held:
        s.close()
    assert not good_err, good_err[:3]
    assert not failures, failures[:5]
    assert sent["frames"] >= 1500
    assert good_stats["ok"] > 100 and good_stats["worst"] < 2.0, good_stats
    bound = OPTS["max_conns"] + OPTS["max_pending"] + OPTS["workers"] + 1
    assert peak_threads <= bound, (peak_threads, bound)
    assert peak_rss - rss0 < 200 << 20, (peak_rss - rss0) >> 20
    # one log line per dropped connection, naming why
    drops = [r.getMessage() for r in caplog.records if "connection dropped" in r.getMessage()]
    assert drops and len(drops) <= sent["frames"]
    for why in ("bad magic", "protocol version 9", "too large", "not msgpack"):
        assert any(why in m for m in drops), why
    # everything hostile gets closed (timeouts); the good client is still served
    end = time.monotonic() + 10
    while (lst.counts()["active"] > good.stats()["streams"] or lst.counts()["pending"]) \
            and time.monotonic() < end:
        time.sleep(0.05)
    assert lst.counts()["active"] <= good.stats()["streams"] and lst.counts()["pending"] == 0
    assert good.request("echo", {"after": 1}, b"z") == ({"after": 1}, b"z")
    good.close()


def test_an_op_not_served_is_enosys_for_that_request_only(server):
    """A peer of another acache version asks for an op this node does not serve: that
    request fails with ENOSYS (its payload read and dropped), the connection serves on."""
    lst = server()
    conn = TcpTransport(SECRET, **{**OPTS, "streams": 1}).connect(lst.address)
    for payload in (b"", os.urandom(300_000)):
        with pytest.raises(RemoteError) as err:
            conn.request("rm -rf", {"x": 1}, payload)
        assert err.value.errno == errno.ENOSYS
        assert conn.request("echo", {"after": len(payload)}, b"z") == ({"after": len(payload)}, b"z")
    assert lst.dropped == 0
    # a raw frame too: the reply is an ERROR frame for that request id, not a closed socket
    s = _authed(lst)
    m = wire.encode_meta(["no-such-op", {}])
    s.sendall(wire.pack_header(wire.REQUEST, 7, len(m), 5) + m + b"12345")
    s.settimeout(5)
    hdr = s.recv(wire.HEADER, socket.MSG_WAITALL)
    assert len(hdr) == wire.HEADER and hdr[5] == wire.ERROR, hdr
    s.close()
    conn.close()


def test_handshake_slowloris_cannot_lock_out_new_peers(server):
    lst = server()
    hanging = []
    for _ in range(100):                   # more half-handshakes than max_pending
        s = _connect(lst)
        s.sendall(wire.pack_header(wire.HELLO, 0, 100)[:20])
        hanging.append(s)
    t0 = time.monotonic()
    conn = TcpTransport(SECRET, **OPTS).connect(lst.address)
    assert conn.request("echo", {"x": 1}) == ({"x": 1}, b"")
    assert time.monotonic() - t0 < 2
    assert lst.counts()["pending"] <= OPTS["max_pending"]
    closed = sum(_closed_by_server(s, 3) for s in hanging)
    assert closed == len(hanging)          # the oldest made room, the rest timed out
    for s in hanging:
        s.close()
    conn.close()


def test_connection_cap_refuses_with_busy(server):
    lst = server(max_conns=3)
    conns = [TcpTransport(SECRET, **{**OPTS, "streams": 1}).connect(lst.address) for _ in range(3)]
    with pytest.raises(PeerUnavailable, match="busy"):
        TcpTransport(SECRET, **OPTS).connect(lst.address)
    conns[0].close()
    end = time.monotonic() + 5
    while lst.counts()["active"] >= 3 and time.monotonic() < end:
        time.sleep(0.02)
    TcpTransport(SECRET, **OPTS).connect(lst.address).close()
    for c in conns[1:]:
        c.close()


# -- a broken server ------------------------------------------------------------------------
def _fake_server(behaviour):
    srv = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve(s):
        try:
            s.settimeout(10)
            auth.server_handshake(s, SECRET, {"version": 1, "max_payload": 1 << 30})
            auth.ready(s)
            h = wire.parse_header(wire.recv_exact(s, wire.HEADER), wire.Limits(), {wire.REQUEST})
            wire.recv_exact(s, h.meta_len + h.payload_len)
            behaviour(s, h.rid)
            done.wait(30)
        except OSError:                 # a stream the client opened and closed unused
            pass
        finally:
            s.close()

    def run():                          # every connection (the client's pool may open several)
        while True:
            try:
                s, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(s,), daemon=True).start()
    threading.Thread(target=run, daemon=True).start()
    return f"127.0.0.1:{srv.getsockname()[1]}", done, srv


@pytest.mark.parametrize("what", ["stall-mid-payload", "stall-before-reply", "garbage-reply"])
def test_a_server_that_stops_mid_reply_never_hangs_the_client(what):
    def behaviour(s, rid):
        if what == "stall-mid-payload":
            s.sendall(wire.pack_header(wire.REPLY, rid, 1, 1 << 20) + b"\x80" + b"y" * 100)
        elif what == "garbage-reply":
            s.sendall(b"\x00" * 64)
    addr, done, srv = _fake_server(behaviour)
    conn = TcpTransport(SECRET, **OPTS).connect(addr)
    t0 = time.monotonic()
    exc = ProtocolError if what == "garbage-reply" else PeerUnavailable
    with pytest.raises(exc):
        conn.read_into("read", {}, memoryview(bytearray(1 << 20)))
    assert time.monotonic() - t0 < 2 * OPTS["timeout"] + 0.5
    done.set()
    conn.close()
    srv.close()


def test_idle_streams_are_retired_before_the_server_closes_them(server):
    lst = server(idle_timeout=1.0)
    conn = TcpTransport(SECRET, **OPTS).connect(lst.address)
    assert conn.peer_capabilities["idle_timeout"] == 1.0
    assert conn.request("echo", {"n": 1}) == ({"n": 1}, b"")
    time.sleep(0.6)                      # the idle time itself is what is tested
    assert conn.request("echo", {"n": 2}) == ({"n": 2}, b"")
    assert conn.stats()["streams_opened"] == 2          # retired at 0.5 s, a new one
    time.sleep(1.5)                      # the server closed it meanwhile: still fine
    assert conn.request("echo", {"n": 3}) == ({"n": 3}, b"")
    conn.close()
