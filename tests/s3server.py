"""A real S3-protocol server on 127.0.0.1 for tests: moto's server mode.

    with S3Server() as srv:            # starts moto, creates srv.bucket
        store = S3Store(srv.url("prefix"), **srv.options())
        srv.stop()                     # "S3 is down": connections refused
        srv.start()                    # back, same port, same data

moto runs as a subprocess on a private port; tests talk to it through a small
TCP relay on ``srv.port``.  ``stop()`` closes the relay (new connections are
refused, open ones are reset) while moto keeps its state, so ``start()``
brings the same objects back on the same port.  ``kill()`` ends moto itself.

``auth=True`` makes moto check credentials (IAM): an IAM user with full S3
access is created and its key is in ``srv.access_key``/``srv.secret_key``;
any other key is rejected (InvalidAccessKeyId / SignatureDoesNotMatch).
Without it moto accepts any credentials.  ``tls=True`` serves https with a
self-signed certificate (use verify_tls=False).

What reached the server, for tests that count traffic: ``srv.requests()``
(method, key, query) of every S3 request moto answered, from its request log;
``srv.bytes_up`` / ``srv.bytes_down`` through the relay.  ``srv.throttle =
bytes_per_second`` slows client-to-server traffic (all connections together)
so that an upload is still running when a test kills something.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager

import urllib3

_HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Meter:
    """Byte counters of the relay, and a rate limit on client-to-server bytes."""

    def __init__(self) -> None:
        self.up = self.down = 0
        self.rate: float | None = None      # bytes/s upstream, None = unlimited
        self._next = 0.0                     # when the link is free again
        self._lock = threading.Lock()

    def count(self, n: int, upstream: bool) -> None:
        with self._lock:
            if not upstream:
                self.down += n
                return
            self.up += n
            if not self.rate:
                return
            now = time.monotonic()
            self._next = max(self._next, now) + n / self.rate
            delay = self._next - now
        if delay > 0:
            time.sleep(delay)


class _Relay:
    """Forward TCP connections from 127.0.0.1:port to 127.0.0.1:target."""

    def __init__(self, port: int, target: int, meter: _Meter | None = None):
        self.port, self.target = port, target
        self.meter = meter or _Meter()
        self._lsock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + 10
        while True:
            try:
                ls.bind(("127.0.0.1", self.port))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        ls.listen(128)
        self._lsock = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()

    def stop(self) -> None:
        ls, self._lsock = self._lsock, None
        if ls is not None:
            try:
                ls.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            ls.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            try:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                c.close()  # RST: the client sees "connection reset"
            except OSError:
                pass

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                c, _ = ls.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                c.close()
                continue
            with self._lock:
                if self._lsock is not ls:
                    c.close()
                    b.close()
                    return
                self._conns.update((c, b))
            for x, y, up in ((c, b, True), (b, c, False)):
                threading.Thread(target=self._pump, args=(x, y, up), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket, upstream: bool) -> None:
        try:
            while True:
                data = a.recv(1 << 16)
                if not data:
                    break
                self.meter.count(len(data), upstream)
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                self._conns.discard(a)
                self._conns.discard(b)
            a.close()


class S3Server:
    def __init__(self, bucket: str = "acache-test", *, auth: bool = False, tls: bool = False,
                 region: str = "us-east-1"):
        self.bucket, self.auth, self.tls, self.region = bucket, auth, tls, region
        self.port = free_port()
        self.backend_port: int | None = None
        self.access_key, self.secret_key = "testing", "testing"
        self._proc: subprocess.Popen | None = None
        self._relay: _Relay | None = None
        self._meter = _Meter()
        self._log = None

    # -- lifecycle -------------------------------------------------------------
    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._relay is not None

    def start(self) -> "S3Server":
        if self._proc is None:
            self._spawn()
        if self._relay is None:
            self._relay = _Relay(self.port, self.backend_port, self._meter)
            self._relay.start()
        return self

    def stop(self) -> None:
        """Take the server off the network (refuse connections); moto keeps its data."""
        if self._relay is not None:
            self._relay.stop()
            self._relay = None

    def kill(self) -> None:
        self.stop()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._log is not None:
            self._log.close()
            try:
                os.unlink(self._log.name)
            except OSError:
                pass
            self._log = None

    close = kill

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()

    def _spawn(self) -> None:
        self.backend_port = free_port()
        self._log = tempfile.NamedTemporaryFile(prefix="moto-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
               "-p", str(self.backend_port)] + (["--ssl"] if self.tls else [])
        env = dict(os.environ, MOTO_PORT=str(self.backend_port))
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
        base = f"{self.scheme}://127.0.0.1:{self.backend_port}"
        http = urllib3.PoolManager(cert_reqs="CERT_NONE", retries=False)
        deadline = time.monotonic() + 60
        with _quiet_tls():
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"moto server exited; see {self._log.name}")
                try:
                    if http.request("GET", base + "/moto-api/", timeout=2).status == 200:
                        break
                except urllib3.exceptions.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"moto server did not start; see {self._log.name}")
                time.sleep(0.1)
            self._setup(base, http)

    def _setup(self, base: str, http: urllib3.PoolManager) -> None:
        import boto3  # moto's dependency
        kw = dict(endpoint_url=base, region_name=self.region, verify=False,
                  aws_access_key_id="testing", aws_secret_access_key="testing")
        boto3.client("s3", **kw).create_bucket(Bucket=self.bucket)
        if not self.auth:
            return
        iam = boto3.client("iam", **kw)
        iam.create_user(UserName="acache")
        iam.put_user_policy(UserName="acache", PolicyName="s3", PolicyDocument=(
            '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", '
            '"Action": "s3:*", "Resource": "*"}]}'))
        key = iam.create_access_key(UserName="acache")["AccessKey"]
        self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]
        r = http.request("POST", base + "/moto-api/reset-auth", body=b"0")
        if r.status != 200:
            raise RuntimeError(f"moto refused to enable auth: {r.status} {r.data!r}")

    # -- what reached the server ---------------------------------------------------
    @property
    def throttle(self) -> float | None:
        return self._meter.rate

    @throttle.setter
    def throttle(self, bytes_per_second: float | None) -> None:
        self._meter.rate = bytes_per_second

    @property
    def bytes_up(self) -> int:
        return self._meter.up

    @property
    def bytes_down(self) -> int:
        return self._meter.down

    _REQ = re.compile(r'"([A-Z]+) (/[^ ?"]*)\??([^ "]*) HTTP/[0-9.]+" (\d+)')

    def requests(self, bucket: str | None = None) -> list[tuple[str, str, str, int]]:
        """(method, key, query, status) of every request moto logged for the bucket, in
        order (a request is logged as it is answered).  Bucket-level requests (listings,
        ListMultipartUploads) have key ''."""
        from urllib.parse import unquote
        bucket = bucket or self.bucket
        if self._log is None:
            return []
        self._log.flush()
        with open(self._log.name, errors="replace") as f:
            text = re.sub(r"\x1b\[[0-9;]*m", "", f.read())   # werkzeug colours non-2xx lines
        out = []
        for m in self._REQ.finditer(text):
            method, path, query, status = m.groups()
            b, _, key = path.lstrip("/").partition("/")
            if b == bucket:
                out.append((method, unquote(key), query, int(status)))
        return out

    # -- what tests use ----------------------------------------------------------
    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    def options(self, **over) -> dict:
        """Keyword arguments for S3Store."""
        o = dict(endpoint=self.endpoint, region=self.region, access_key=self.access_key,
                 secret_key=self.secret_key, addressing="path")
        if self.tls:
            o["verify_tls"] = False
        o.update(over)
        return o

    def env(self) -> dict[str, str]:
        """The same, as ACACHE_S3_* environment variables."""
        return {f"ACACHE_S3_{k.upper()}": str(v) for k, v in self.options().items()}

    def client(self):
        """A minio client for setting up and inspecting the bucket directly."""
        from minio import Minio
        return Minio(f"127.0.0.1:{self.port}", access_key=self.access_key,
                     secret_key=self.secret_key, secure=self.tls, region=self.region,
                     cert_check=not self.tls)

    def objects(self, prefix: str, markers: bool = False) -> dict[str, bytes]:
        """Every object under prefix/: key relative to it -> bytes; directory markers
        (keys ending in '/', as b'') only with ``markers``."""
        c = self.client()
        out = {}
        for o in c.list_objects(self.bucket, prefix=prefix + "/", recursive=True):
            if o.object_name.endswith("/") and not markers:
                continue
            r = c.get_object(self.bucket, o.object_name)
            try:
                out[o.object_name[len(prefix) + 1:]] = r.read()
            finally:
                r.close()
                r.release_conn()
        return out

    # -- credentials (auth=True) ----------------------------------------------------
    @contextmanager
    def _admin(self):
        """boto3 IAM client on the backend, with moto's auth check off meanwhile."""
        import boto3
        http = urllib3.PoolManager(cert_reqs="CERT_NONE", retries=False)
        base = f"{self.scheme}://127.0.0.1:{self.backend_port}"
        with _quiet_tls():
            http.request("POST", base + "/moto-api/reset-auth", body=b"1000000")
            try:
                yield boto3.client("iam", endpoint_url=base, region_name=self.region, verify=False,
                                   aws_access_key_id="testing", aws_secret_access_key="testing")
            finally:
                http.request("POST", base + "/moto-api/reset-auth", body=b"0")

    def new_key(self) -> tuple[str, str]:
        """A second access key for the user (auth=True); the current one keeps working."""
        with self._admin() as iam:
            key = iam.create_access_key(UserName="acache")["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def revoke_key(self, access_key: str) -> None:
        """Delete an access key: requests signed with it get InvalidAccessKeyId."""
        with self._admin() as iam:
            iam.delete_access_key(UserName="acache", AccessKeyId=access_key)

    def make_bucket(self, name: str) -> None:
        self.client().make_bucket(name)

    def open_uploads(self, bucket: str | None = None, prefix: str = "") -> list[tuple[str, str]]:
        """(key, upload id) of the multipart uploads in progress."""
        c = self.client()
        res = c._list_multipart_uploads(bucket or self.bucket, prefix=prefix)
        return [(u.object_name, u.upload_id) for u in res.uploads]


class _quiet_tls:
    """Silence urllib3's InsecureRequestWarning for the self-signed moto certificate."""

    def __enter__(self):
        import warnings
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)

    def __exit__(self, *exc):
        self._w.__exit__(*exc)
