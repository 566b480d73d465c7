"""The things a benchmark writes to: an S3-protocol server (moto), an acache node + mount,
and an rclone mount of the same server. Each is started through ``Owned`` so the harness
always tears it down."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.procs import Owned, detach, is_mounted, stop_process, wait_for

MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the S3 server --------------------------------------------------------------------------
class S3Server:
    """moto's server mode on 127.0.0.1 (any credentials are accepted)."""

    access_key = secret_key = "bench"
    region = "us-east-1"

    def __init__(self, root: Path, bucket: str = "acache-bench") -> None:
        self.root, self.bucket = root, bucket
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, owned: Owned) -> "S3Server":
        self.port = free_port()
        moto = Path(sys.executable).with_name("moto_server")
        argv = [str(moto)] if moto.exists() else [sys.executable, "-m", "moto.server"]
        log = open(self.root / "moto.log", "ab")
        self.proc = owned.spawn([*argv, "-H", "127.0.0.1", "-p", str(self.port)],
                                stdout=log, stderr=subprocess.STDOUT)
        log.close()

        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited; see {self.root / 'moto.log'}")
            try:
                return urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=2).status == 200
            except (urllib.error.URLError, OSError):
                return False
        wait_for(up, 60, "the moto S3 server")
        self.client().make_bucket(self.bucket)
        return self

    def client(self):
        from minio import Minio
        return Minio(f"127.0.0.1:{self.port}", access_key=self.access_key,
                     secret_key=self.secret_key, secure=False, region=self.region)

    def acache_env(self) -> dict[str, str]:
        return {"ACACHE_S3_ENDPOINT": self.endpoint, "ACACHE_S3_REGION": self.region,
                "ACACHE_S3_ACCESS_KEY": self.access_key, "ACACHE_S3_SECRET_KEY": self.secret_key,
                "ACACHE_S3_ADDRESSING": "path"}

    def worker_env(self) -> dict[str, str]:
        """For the checkpoint workers' direct-to-S3 saves."""
        return {"BENCH_S3_ENDPOINT": f"127.0.0.1:{self.port}", "BENCH_S3_REGION": self.region,
                "BENCH_S3_ACCESS_KEY": self.access_key, "BENCH_S3_SECRET_KEY": self.secret_key}

    def rclone_env(self, remote: str) -> dict[str, str]:
        p = f"RCLONE_CONFIG_{remote.upper()}_"
        return {p + "TYPE": "s3", p + "PROVIDER": "Other", p + "ENDPOINT": self.endpoint,
                p + "ACCESS_KEY_ID": self.access_key, p + "SECRET_ACCESS_KEY": self.secret_key,
                p + "REGION": self.region, p + "FORCE_PATH_STYLE": "true"}

    def empty(self, prefix: str) -> int:
        """Delete every object under prefix; returns how many."""
        from minio.deleteobjects import DeleteObject
        c = self.client()
        keys = [DeleteObject(o.object_name) for o in c.list_objects(self.bucket, prefix, recursive=True)]
        if keys:
            errs = list(c.remove_objects(self.bucket, keys))
            if errs:
                raise RuntimeError(f"S3 delete failed: {errs[0]}")
        return len(keys)

    def size_of(self, prefix: str) -> int:
        return sum(o.size or 0 for o in self.client().list_objects(self.bucket, prefix, recursive=True))


# -- an acache node + mount ------------------------------------------------------------------
# engine labels of the harness that are an engine plus settings
ENGINE_VARIANTS = {"native-nopt": ("native", {"ACACHE_PASSTHROUGH": "false"})}


class AcacheTarget:
    """`acache up --foreground` as our child, then `acache mount` through the CLI."""

    def __init__(self, root: Path, engine: str, ufs: str, env: dict[str, str] | None = None) -> None:
        engine, variant_env = ENGINE_VARIANTS.get(engine, (engine, {}))
        env = {**(env or {}), **variant_env}
        self.root, self.engine, self.ufs = root, engine, ufs
        # the home holds the control socket, whose path must fit in 107 bytes: keep it short,
        # and the cache (on the benchmarked filesystem) under root
        self.home = Path(tempfile.mkdtemp(prefix=f"acb-{engine}-"))
        self.mnt = root / "mnt"
        self.env = dict(os.environ, ACACHE_HOME=str(self.home), ACACHE_UFS=ufs,
                        ACACHE_ENGINE=engine, ACACHE_CACHE_DIR=str(root / "cache"), **(env or {}))
        self.proc: subprocess.Popen | None = None
        self.passthrough = False
        self.engine_used = ""
        self.note = ""

    @property
    def socket(self) -> Path:
        return self.home / "acache.sock"

    def _cli(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "acache.cli", *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join((self.home / "acache.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def start(self, owned: Owned, mount_timeout: float) -> bool:
        """Start the node and mount; False (with self.note) if it does not mount in time."""
        from acache.node.client import is_running
        self.home.mkdir(parents=True, exist_ok=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        log = open(self.home / "acache.log", "ab")
        self.proc = owned.spawn([sys.executable, "-m", "acache.cli", "up", "--foreground"],
                                env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        owned.mounted(self.mnt)     # undone LIFO: `acache down` first, then detach, then kill
        owned.on_close(self.stop)
        try:
            wait_for(lambda: self._died() or is_running(self.socket), 60,
                     f"the acache node ({self.engine})")
            if self.proc.poll() is not None:
                self.note = f"node exited: {self.log_tail(1)}"
                return False
            p = self._cli("mount", str(self.mnt), "--engine", self.engine, timeout=mount_timeout)
        except subprocess.TimeoutExpired:
            self.note = f"`acache mount --engine {self.engine}` did not return within {mount_timeout:g}s"
            return False
        except TimeoutError as e:
            self.note = str(e)
            return False
        if p.returncode != 0:
            self.note = (p.stderr.strip() or p.stdout.strip()).splitlines()[-1:] or ["mount failed"]
            self.note = self.note[0]
            return False
        st = self.status()
        self.passthrough = bool(st.get("passthrough"))
        self.engine_used = st.get("engine", "")
        if self.engine_used != self.engine:
            self.note = f"asked for {self.engine}, got {self.engine_used}"
            return False
        return True

    def _died(self) -> bool:
        return self.proc.poll() is not None

    def status(self) -> dict:
        from acache.node.client import Client
        with Client(self.socket, timeout=30) as c:
            return c.call("status")

    def flush(self, timeout: float = 1800) -> float:
        """The durability barrier (what `acache flush --wait` calls); returns its seconds."""
        from acache.node.client import Client
        t0 = time.perf_counter()
        with Client(self.socket, timeout=30) as c:
            c.flush(None, timeout)
        return time.perf_counter() - t0

    def stop(self) -> None:
        """`acache down --no-flush`, then end the daemon and detach whatever is left."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self._cli("down", "--no-flush", timeout=30)
            except subprocess.TimeoutExpired:
                pass
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                stop_process(self.proc)
        detach(self.mnt)
        if self.proc is None or self.proc.poll() is not None:
            shutil.rmtree(self.home, ignore_errors=True)


# -- rclone mount ---------------------------------------------------------------------------
class RcloneTarget:
    """`rclone mount --vfs-cache-mode writes` of the same S3 server, with its rc API for
    knowing when uploads are done."""

    remote = "acbench"

    def __init__(self, root: Path, s3: S3Server, prefix: str = "rclone") -> None:
        self.root, self.s3, self.prefix = root, s3, prefix
        self.mnt = root / "mnt"
        self.rc_port = 0
        self.proc: subprocess.Popen | None = None
        self.note = ""

    def start(self, owned: Owned, timeout: float = 60) -> bool:
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.rc_port = free_port()
        env = dict(os.environ, **self.s3.rclone_env(self.remote))
        env.pop("AWS_CA_BUNDLE", None)   # rclone's AWS SDK fails on it ("unsupported transport");
        #                                  the server is plain http on 127.0.0.1 anyway
        log = open(self.root / "rclone.log", "ab")
        self.proc = owned.spawn(
            ["rclone", "mount", f"{self.remote}:{self.s3.bucket}/{self.prefix}", str(self.mnt),
             "--vfs-cache-mode", "writes", "--cache-dir", str(self.root / "cache"),
             # moto answers rclone's HEAD ?versionId=null after a multipart upload with 400
             # (an unversioned bucket), and rclone retries the upload for ever: skip that HEAD
             "--s3-no-head",
             "--rc", "--rc-addr", f"127.0.0.1:{self.rc_port}", "--rc-no-auth",
             "--log-file", str(self.root / "rclone.log"), "--log-level", "NOTICE"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        owned.mounted(self.mnt)
        try:
            wait_for(lambda: is_mounted(self.mnt) or self.proc.poll() is not None, timeout,
                     "the rclone mount")
        except TimeoutError as e:
            self.note = str(e)
            return False
        if self.proc.poll() is not None:
            try:
                tail = (self.root / "rclone.log").read_text(errors="replace").strip().splitlines()[-1]
            except (OSError, IndexError):
                tail = ""
            self.note = f"rclone exited ({self.proc.returncode}): {tail}"
            return False
        return True

    def _rc(self, cmd: str, **args) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.rc_port}/{cmd}",
                                     data=json.dumps(args).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def pending_uploads(self) -> int:
        st = self._rc("vfs/stats").get("diskCache", {})
        if st.get("erroredFiles"):
            raise RuntimeError(f"rclone failed to upload {st['erroredFiles']} files; see "
                               f"{self.root / 'rclone.log'}")
        return int(st.get("uploadsInProgress", 0)) + int(st.get("uploadsQueued", 0))

    def wait_uploaded(self, timeout: float = 1800) -> float:
        """Until rclone has no upload queued or running (its write-back delay included)."""
        t0 = time.perf_counter()
        wait_for(lambda: self.pending_uploads() == 0, timeout, "rclone uploads", step=0.2)
        return time.perf_counter() - t0

    def stop(self) -> None:
        detach(self.mnt)
        if self.proc is not None:
            stop_process(self.proc)
