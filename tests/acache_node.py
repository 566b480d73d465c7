"""Drive a real acache node + FUSE mount from tests: the `acache` CLI in a
throwaway ACACHE_HOME, an under-storage directory (or any URL), kill -9."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ACACHE = [sys.executable, "-m", "acache.cli"]


def wait_gone_after_sigkill(pid: int, mnt: Path, must: bool = True) -> None:
    """Wait until a SIGKILLed daemon is gone.  A daemon whose thread sits in the kernel
    waiting for page locks of its own in-flight READs (the native engine's page drop at
    close, NOTIFY_INVAL_INODE, without passthrough) cannot finish dying until its FUSE
    connection is aborted -- as an operator does (`umount -f`, or writing the connection's
    `abort` file): after 5 s the test does that, says so, and requires the daemon gone."""
    def gone(within: float) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.01)
        return False
    if gone(5):
        return
    from acache.fs.native.mount import abort_connection, mount_dev
    dev = mount_dev(os.path.realpath(mnt))
    if dev is not None:
        print(f"kill -9: daemon {pid} still in the kernel after 5 s: aborting FUSE connection {dev[1]}")
        abort_connection(dev[1])
    assert gone(10) or not must, f"kill -9: the daemon (pid {pid}) is still there after 15 s"


def errno_of(fn) -> int:
    """0 if ``fn()`` worked, else its errno (an OSError is the only acceptable failure)."""
    try:
        fn()
        return 0
    except OSError as e:
        assert e.errno, e
        return e.errno


def mount_tmpfs(d: Path, size: str = "200m") -> Path:
    """A tmpfs of ``size`` on the new directory ``d`` (a small disk for full-disk tests);
    undo with umount_tmpfs."""
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], check=True)
    return d


def umount_tmpfs(d: Path) -> None:
    subprocess.run(["umount", "-l", str(d)], check=False)


def fuse_mounts() -> list[str]:
    with open("/proc/mounts") as f:
        return [ln.split()[1] for ln in f if ln.split()[2].startswith("fuse")]


def files_under(root: Path) -> dict[str, bytes]:
    """Every file below ``root`` (relative path -> bytes).  A file that goes away
    between the listing and its read was in flight (the persister renames its temp
    file into place while a test polls): it is left out of this snapshot."""
    out = {}
    for p in sorted(root.rglob("*")):
        try:
            if p.is_file():
                out[str(p.relative_to(root))] = p.read_bytes()
        except FileNotFoundError:
            continue
    return out


class AcacheNode:
    start_timeout = 120.0      # seconds for `up` and `mount` (the rdma VM emulates: slower)
    def __init__(self, root: Path, engine: str = "pyfuse3", ufs: str | None = None,
                 flush_delay: float = 0.2, extra_env: dict | None = None,
                 config: str | None = None) -> None:
        self.root = Path(root)
        self.home = self.root / "home"
        self.mnt = self.root / "mnt"
        self.ufs_dir = self.root / "ufs"
        self.ufs = ufs or f"file://{self.ufs_dir}"
        self.engine = engine
        self.argv_prefix: list[str] = []    # e.g. nsenter --net=...: where the CLI runs
        self.mnt.mkdir(parents=True, exist_ok=True)
        # engine mode "native-nopt": the native engine with kernel passthrough off
        mode = {"ACACHE_ENGINE": "native", "ACACHE_PASSTHROUGH": "0"} if engine == "native-nopt" \
            else {"ACACHE_ENGINE": engine}
        self.env = dict(os.environ, ACACHE_HOME=str(self.home), ACACHE_FLUSH_DELAY=str(flush_delay),
                        ACACHE_UFS=self.ufs, **mode)
        self.env.update(extra_env or {})
        if config is not None:
            self.home.mkdir(parents=True, exist_ok=True)
            (self.home / "config.toml").write_text(config)

    # -- the CLI --------------------------------------------------------------------
    def cli(self, *args: str, check: bool = True, timeout: float = 120,
            input: str | None = None) -> subprocess.CompletedProcess:
        p = subprocess.run([*self.argv_prefix, *ACACHE, *args], env=self.env,
                           capture_output=True, text=True, errors="surrogateescape",
                           timeout=timeout, input=input)
        if check and p.returncode != 0:
            raise AssertionError(f"acache {' '.join(args)} failed ({p.returncode}):\n"
                                 f"{p.stdout}\n{p.stderr}\n--- log ---\n{self.log_tail()}")
        return p

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join((self.home / "acache.log").read_text().splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def start(self) -> "AcacheNode":
        """up + mount; on any failure, nothing is left running or mounted."""
        try:
            self.cli("up", timeout=self.start_timeout)
            self.cli("mount", str(self.mnt), timeout=self.start_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def flush(self, path: str | None = None, timeout: float = 120) -> None:
        args = ["flush", "--wait", "--timeout", str(timeout)]
        if path:
            args.insert(1, path)
        self.cli(*args, timeout=timeout + 30)

    def status(self, path: str | None = None) -> dict:
        args = ["status", "--json"] + ([path] if path else [])
        return json.loads(self.cli(*args).stdout)

    def status_here(self) -> dict:
        """The daemon's status asked over its socket from this process: no fork+exec of the
        CLI, whose exec would close (FLUSH) every file this process has open on the mount."""
        from acache.node.client import Client
        with Client(self.home / "acache.sock", timeout=30) as c:
            return c.call("status", path=None)

    def pid(self) -> int | None:
        """The daemon's pid (asked over its socket: no CLI start-up), None if none runs."""
        from acache.errors import AcacheError
        from acache.node.client import Client
        try:
            with Client(self.home / "acache.sock", timeout=10) as c:
                return c.call("ping")["pid"]
        except (AcacheError, OSError):
            return None

    def kill9(self, must: bool = True) -> None:
        """SIGKILL the running daemon and wait until it is gone; with ``must`` (a test's
        crash), no daemon to kill is an error rather than a silent clean state."""
        pid = self.pid()
        if not pid:
            assert not must, f"kill -9: no daemon answers\n--- log ---\n{self.log_tail()}"
            return
        os.kill(pid, signal.SIGKILL)
        wait_gone_after_sigkill(pid, self.mnt, must)

    def restart(self) -> None:
        """After a crash: up again, mount again on the same (stale) path."""
        self.cli("up", timeout=self.start_timeout)
        self.cli("mount", str(self.mnt), timeout=self.start_timeout)

    def stop(self) -> None:
        """Teardown: stop without flushing, force-detach whatever is left."""
        try:
            self.cli("down", "--no-flush", check=False, timeout=60)
        except subprocess.TimeoutExpired:
            pass
        self.kill9(must=False)
        if str(self.mnt) in fuse_mounts():
            subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True)

    def ufs_files(self) -> dict[str, bytes]:
        """Everything in a file:// under-storage (relative path -> bytes)."""
        return files_under(self.ufs_dir)
