"""Operations: `status --watch` and `flush --wait` in a non-terminal, systemd readiness
(NOTIFY_SOCKET), and mount(8) through an fstab line (mount.fuse.acache)."""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.acache_node import ACACHE, AcacheNode, fuse_mounts
from tests.e2e.conftest import _need_fuse

MiB = 1 << 20
ESC = "\x1b"


def read_lines(stream, n: int, deadline: float) -> list[tuple[float, str]]:
    """``n`` lines from a pipe, each with the time it arrived (fails at the deadline)."""
    got: list[tuple[float, str]] = []
    buf = b""
    fd = stream.fileno()
    while len(got) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(got)} lines before the deadline: {got}"
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        assert chunk, f"the stream ended after {len(got)} lines: {got} {buf!r}"
        buf += chunk
        while b"\n" in buf and len(got) < n:
            line, buf = buf.split(b"\n", 1)
            got.append((time.monotonic(), line.decode()))
    return got


@pytest.fixture
def node(tmp_path):
    _need_fuse()
    n = AcacheNode(tmp_path, engine="native", flush_delay=0).start()
    yield n
    n.stop()


def test_status_watch_plain_lines_until_sigint(node):
    # SIGINT back to its default in the child: a test run started in the background of a
    # non-interactive shell inherits SIGINT ignored, and Python then keeps it ignored
    p = subprocess.Popen([*ACACHE, "status", "--watch", "--interval", "0.3"], env=node.env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = read_lines(p.stdout, 1, time.monotonic() + 30)
        (node.mnt / "f").write_bytes(os.urandom(MiB))
        lines = first + read_lines(p.stdout, 3, time.monotonic() + 30)
    finally:
        p.send_signal(signal.SIGINT)
        rc = p.wait(30)
        err = p.stderr.read().decode()
    assert rc == 0, (rc, err)          # Ctrl-C is how a watch ends: exit 0
    assert "Traceback" not in err and ESC not in err
    for _, text in lines:
        assert ESC not in text and "\r" not in text, repr(text)
        assert "dirty" in text and "queue" in text and "upload" in text, text
    # lines appear over time, one per interval (not all at the end)
    assert lines[-1][0] - lines[0][0] >= 0.5, lines


def test_status_watch_refuses_bad_arguments(node):
    for args, words in ((["--watch", "--json"], "--watch"), (["--watch", "--interval", "0"], "--interval")):
        p = node.cli("status", *args, check=False)
        assert p.returncode != 0 and words in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_status_shows_upload_limit(tmp_path):
    _need_fuse()
    n = AcacheNode(tmp_path, extra_env={"ACACHE_UPLOAD_LIMIT": "00:00,50MiB/s 23:59,off"})
    try:
        n.cli("up")
        out = n.cli("status").stdout
        assert "upload limit" in out and "timetable 00:00,50MiB/s 23:59,off" in out, out
        assert n.status()["upload_limit"] in ("50 MiB/s", "off")
    finally:
        n.stop()


def test_flush_wait_progress_as_plain_lines(tmp_path):
    _need_fuse()
    # a slow under-storage (4 MiB/s): the barrier takes a few seconds
    n = AcacheNode(tmp_path, engine="native", flush_delay=3600,
                   extra_env={"ACACHE_UPLOAD_LIMIT": "4MiB/s"}).start()
    try:
        for i in range(3):
            (n.mnt / f"f{i}").write_bytes(os.urandom(4 * MiB))
        p = subprocess.Popen([*ACACHE, "flush", "--wait", "--timeout", "60"], env=n.env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        lines = read_lines(p.stdout, 2, time.monotonic() + 60)   # progress: stdout, plain
        rc = p.wait(60)
        out = p.stdout.read().decode()
        rest = p.stderr.read().decode()
        assert rc == 0, (out, rest)
        assert rest == "", rest          # stderr is for a failure's one line
        for _, text in lines:
            assert ESC not in text and "\r" not in text and "persisting:" in text, repr(text)
        assert lines[1][0] - lines[0][0] >= 0.5, lines
        assert ESC not in out + rest and "flushed in" in out
    finally:
        n.stop()


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_sd_notify_ready_only_once_serving(tmp_path, abstract):
    _need_fuse()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"acache-test-notify-{os.getpid()}-{time.monotonic_ns()}"
        sock.bind("\0" + name)
        addr = "@" + name
    else:
        addr = str(tmp_path / "notify.sock")
        sock.bind(addr)
    n = AcacheNode(tmp_path / "n")
    env = dict(n.env, NOTIFY_SOCKET=addr)
    proc = subprocess.Popen([*ACACHE, "up", "--foreground"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        sock.settimeout(60)
        got = []
        while "READY=1" not in got:
            msg = sock.recv(4096).decode()
            # before READY the node must not... after it, it must answer at once
            got += msg.split("\n")
        assert n.pid() == proc.pid, "READY=1 was sent before the node answered its socket"
        assert n.cli("status", "--json").returncode == 0
        proc.send_signal(signal.SIGTERM)
        while "STOPPING=1" not in got:
            got += sock.recv(4096).decode().split("\n")
        assert proc.wait(60) == 0
        assert got.count("READY=1") == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()


def test_sd_notify_not_before_a_failed_start(tmp_path):
    """A node that cannot start (a bad setting) never says READY=1."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    addr = str(tmp_path / "notify.sock")
    sock.bind(addr)
    n = AcacheNode(tmp_path / "n", extra_env={"ACACHE_METRICS": "127.0.0.1:0x"})
    p = subprocess.run([*ACACHE, "up", "--foreground"], env=dict(n.env, NOTIFY_SOCKET=addr),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "metrics" in p.stderr
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(4096)
    sock.close()


def test_fstab_line_mounts_through_the_helper(tmp_path):
    """An fstab line of type fuse.acache, mounted by mount(8) in a scratch mount namespace
    where /sbin holds our mount.fuse.acache (installed by `acache install-helper`)."""
    _need_fuse()
    n = AcacheNode(tmp_path)
    sbin = tmp_path / "sbin"
    sbin.mkdir()
    for entry in os.scandir("/usr/sbin"):          # everything mount(8) may need, plus ours
        (sbin / entry.name).symlink_to(entry.path)
    n.cli("install-helper", "--dir", str(sbin))
    helper = sbin / "mount.fuse.acache"
    assert helper.is_file() and os.access(helper, os.X_OK)
    fstab = tmp_path / "fstab"
    mnt = n.mnt
    fstab.write_text(f"# scratch fstab\nacache {mnt} fuse.acache defaults,_netdev,noauto,"
                     f"home={n.home},ufs=file://{n.ufs_dir},engine=native,flush-delay=0 0 0\n")
    script = f"""set -e
mount --bind {sbin} /usr/sbin
mount -T {fstab} {mnt}
findmnt -n -o FSTYPE {mnt}
echo hello > {mnt}/hello.txt
cat {mnt}/hello.txt
{sys.executable} -m acache.cli flush --wait --timeout 60 >/dev/null
umount {mnt}
{sys.executable} -m acache.cli down
"""
    env = {k: v for k, v in n.env.items() if not k.startswith("ACACHE_")}   # only fstab's
    env["PYTHONPATH"] = n.env.get("PYTHONPATH", "")
    env["ACACHE_HOME"] = str(n.home)          # for the flush/down lines of the script only
    try:
        p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                           env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
        assert p.returncode == 0, f"{p.stdout}\n{p.stderr}\n{n.log_tail()}"
        lines = p.stdout.splitlines()
        assert "fuse.acache" in lines and "hello" in lines, p.stdout
        assert any(ln.startswith(f"mounted {mnt} (native engine") for ln in lines), p.stdout
        assert (n.ufs_dir / "hello.txt").read_text() == "hello\n"
        assert str(mnt) not in fuse_mounts()        # never visible outside the namespace
    finally:
        n.stop()


def test_mount_helper_refuses_bad_options(tmp_path):
    from acache.mount_helper import main
    assert main(["acache", str(tmp_path), "-o", "rw,bogus=1"]) == 1
    assert main(["acache", str(tmp_path), "-o", "ro"]) == 1
    assert main(["acache"]) == 1
    assert main(["acache", str(tmp_path), "-f", "-o", "defaults,_netdev,x-systemd.automount,home=/x"]) == 0


def test_mount_helper_maps_options():
    from acache.mount_helper import parse
    src, mp, env, fake = parse(["s3://b/p", "/ckpt", "-o", "rw,_netdev,cache-size=50GiB,engine=native,"
                                "upload_limit=100MiB/s,home=/var/lib/acache", "-n"])
    assert (src, mp, fake) == ("s3://b/p", "/ckpt", False)
    assert env == {"ACACHE_UFS": "s3://b/p", "ACACHE_CACHE_SIZE": "50GiB", "ACACHE_ENGINE": "native",
                   "ACACHE_UPLOAD_LIMIT": "100MiB/s", "ACACHE_HOME": "/var/lib/acache"}
    assert Path  # (keeps the import used)
