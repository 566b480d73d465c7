"""The handshake every peer connection starts with: version, capabilities, mutual HMAC.

    client -> HELLO  C = {"caps": {...}, "nonce": 32 random bytes, "auth": bool}
    server -> HELLO  {"body": S, "proof": HMAC(k, "acache-peer/1 server\\0" + C + S) or b""}
                     with S = msgpack {"caps": {...}, "nonce": 32 random bytes, "auth": bool}
    client -> PROOF  {"proof": HMAC(k, "acache-peer/1 client\\0" + C + S) or b""}
    server -> READY  {}            (or ERROR {"errno": EACCES, "msg": why}, then close)

``k`` is the cluster secret (``secret_file``).  Each proof covers both nonces and both sides'
exact hello bytes (capabilities included, so they cannot be altered in between), and the two
labels differ, so a proof can neither be replayed on a later connection (the other side's
nonce is fresh) nor reflected back.  Proofs are compared with ``hmac.compare_digest``.

A side with a secret requires the other to prove it; a side without one accepts only if the
address it listens on / connects to is loopback (settings refuse such a config up front).
Capabilities are a dict each side advertises ({"version": 1, "transport": "tcp", "ops": [...],
...}); the RDMA negotiation adds its queue-pair parameters here.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import stat

from acache.net import wire
from acache.net.transport import AuthError, FrameError, PeerUnavailable, ProtocolError, TransportError

LABEL_SERVER = b"acache-peer/1 server\0"
LABEL_CLIENT = b"acache-peer/1 client\0"
MIN_SECRET = 16


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); ValueError says why not."""
    if not isinstance(address, str):
        raise ValueError("expected host:port")
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host:
        raise ValueError("expected host:port (e.g. 10.0.0.5:7470)")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError("expected [ipv6]:port")
        host = host[1:-1]
    elif ":" in host:
        raise ValueError("an IPv6 address needs brackets: [addr]:port")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"port {port!r}: expected 0 to 65535")
    return host, int(port)


def is_loopback(address: str) -> bool:
    host, _ = parse_address(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False           # a host name: it may resolve anywhere


def load_secret(path: str | os.PathLike) -> bytes:
    """The cluster secret: the file's bytes (trailing whitespace dropped), at least 16 bytes.
    Refused, as ssh does with private keys, when group or others may read or write it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        raise AuthError(f"secret_file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AuthError(f"secret_file {path}: not a regular file")
        if st.st_mode & 0o077:
            raise AuthError(f"secret_file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets others read "
                            "it; chmod 600 it")
        data = os.read(fd, 1 << 16).rstrip()
    finally:
        os.close(fd)
    if len(data) < MIN_SECRET:
        raise AuthError(f"secret_file {path}: {len(data)} bytes; a secret needs at least {MIN_SECRET} "
                        "(e.g. head -c 32 /dev/urandom | base64)")
    return data


# -- the exchange -----------------------------------------------------------------------------
def _send(sock: socket.socket, ftype: int, meta: bytes) -> None:
    wire.send_buffers(sock, [wire.pack_header(ftype, 0, len(meta)), meta])


def _recv(sock: socket.socket, *allowed: int) -> tuple[int, bytes]:
    h = wire.parse_header(wire.recv_exact(sock, wire.HEADER), wire.HANDSHAKE_LIMITS, set(allowed))
    return h.type, bytes(wire.recv_exact(sock, h.meta_len))


def _proof(secret: bytes | None, label: bytes, c: bytes, s: bytes) -> bytes:
    return hmac.new(secret, label + c + s, hashlib.sha256).digest() if secret else b""


def _hello(raw: bytes) -> dict:
    d = wire.decode_map(raw)
    if not (isinstance(d.get("caps"), dict) and isinstance(d.get("nonce"), bytes)
            and len(d["nonce"]) == 32 and isinstance(d.get("auth"), bool)):
        raise ProtocolError("malformed hello")
    return d


def _remote_refusal(raw: bytes) -> TransportError:
    try:
        d = wire.decode_map(raw)
        msg, err = str(d.get("msg", "refused")), d.get("errno")
    except FrameError:
        msg, err = "refused", None
    if err == errno.EBUSY:         # at its connection cap: try again later
        return PeerUnavailable(f"the peer is busy: {msg}")
    return AuthError(f"the peer refused the handshake: {msg}")


def client_handshake(sock: socket.socket, secret: bytes | None, caps: dict) -> dict:
    """Run the client side on a connected socket; the server's capabilities, or AuthError /
    ProtocolError (OSError from the socket passes through)."""
    c = wire.encode_meta({"caps": caps, "nonce": secrets.token_bytes(32), "auth": secret is not None})
    _send(sock, wire.HELLO, c)
    ftype, raw = _recv(sock, wire.HELLO, wire.ERROR)
    if ftype == wire.ERROR:
        raise _remote_refusal(raw)
    outer = wire.decode_map(raw)
    s, proof = outer.get("body"), outer.get("proof")
    if not isinstance(s, bytes) or not isinstance(proof, bytes):
        raise ProtocolError("malformed server hello")
    server = _hello(s)
    if secret is not None:
        if not server["auth"]:
            raise AuthError("the peer has no cluster secret (and we require one)")
        if not hmac.compare_digest(proof, _proof(secret, LABEL_SERVER, c, s)):
            raise AuthError("the peer does not know the cluster secret")
    elif server["auth"]:
        raise AuthError("the peer requires the cluster secret (set secret_file)")
    _send(sock, wire.PROOF, wire.encode_meta({"proof": _proof(secret, LABEL_CLIENT, c, s)}))
    ftype, raw = _recv(sock, wire.READY, wire.ERROR)
    if ftype == wire.ERROR:
        raise _remote_refusal(raw)
    return server["caps"]


def refuse(sock: socket.socket, err: int, msg: str) -> None:
    """Tell a client at the READY step why it is refused (best effort)."""
    try:
        _send(sock, wire.ERROR, wire.encode_meta({"errno": err, "msg": msg}))
    except OSError:
        pass


def server_handshake(sock: socket.socket, secret: bytes | None, caps: dict) -> dict:
    """Run the server side on an accepted socket up to (not including) READY: the client's
    capabilities, or AuthError (the client was told why) / FrameError / ProtocolError /
    OSError.  The caller sends ``ready(sock)`` or ``refuse(...)``."""
    ftype, c = _recv(sock, wire.HELLO)
    client = _hello(c)
    s = wire.encode_meta({"caps": caps, "nonce": secrets.token_bytes(32), "auth": secret is not None})
    _send(sock, wire.HELLO, wire.encode_meta({"body": s, "proof": _proof(secret, LABEL_SERVER, c, s)}))
    if secret is not None and not client["auth"]:
        # the client refuses us on reading our hello; it may also stay and send a proof
        why = "no cluster secret offered"
    else:
        why = ""
    ftype, raw = _recv(sock, wire.PROOF)
    proof = wire.decode_map(raw).get("proof")
    if not isinstance(proof, bytes):
        raise ProtocolError("malformed proof")
    if not why and secret is not None and not hmac.compare_digest(proof, _proof(secret, LABEL_CLIENT, c, s)):
        why = "wrong proof of the cluster secret"
    if why:
        refuse(sock, errno.EACCES, why)
        raise AuthError(why)
    return client["caps"]


def ready(sock: socket.socket) -> None:
    _send(sock, wire.READY, wire.encode_meta({}))
