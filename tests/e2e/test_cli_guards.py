"""Guards a real node applies: overlapping directories, bad settings, a bounded control
socket, and what `down --no-flush` says.  Each refusal is one line and a non-zero exit."""
from __future__ import annotations

import os
import socket
import struct
import time

import msgpack

from tests.acache_node import AcacheNode, fuse_mounts
from tests.e2e.contract_util import one_line_error, ufs_real


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_mount_overlapping_the_under_storage_or_state_is_refused(make_node, tmp_path):
    n = make_node(start=False)
    n.cli("up")
    inner = n.ufs_dir / "inner"
    inner.mkdir(parents=True)
    p = n.cli("mount", str(inner), check=False)              # the probe: it showed itself
    one_line_error(p)
    assert "inside the under-storage" in p.stderr, p.stderr
    link = tmp_path / "link"
    link.symlink_to(n.ufs_dir)
    p = n.cli("mount", str(link / "inner"), check=False)     # the same through a symlink
    one_line_error(p)
    assert "inside the under-storage" in p.stderr, p.stderr
    (n.home / "m").mkdir()
    p = n.cli("mount", str(n.home / "m"), check=False)
    one_line_error(p)
    assert "inside the state directory" in p.stderr, p.stderr
    assert not [m for m in fuse_mounts() if m.startswith(str(tmp_path))]
    n.cli("mount", str(n.mnt))                               # a good mount point still works
    (n.mnt / "inner").mkdir(exist_ok=True)
    (n.mnt / "inner" / "x").write_bytes(b"x")
    n.flush()
    assert ufs_real(n.ufs_files()) == {"inner/x": b"x"}


def test_up_with_overlapping_directories_is_refused(tmp_path):
    n = AcacheNode(tmp_path)
    try:
        for args, why in (
                (["--cache-dir", str(n.ufs_dir / "cache")], "inside the under-storage"),
                (["--ufs", f"file://{n.home}"], "same directory"),
                (["--ufs", f"file://{tmp_path}"], "inside the under-storage"),
                (["--cache-dir", str(tmp_path)], "inside the cache directory")):
            p = n.cli("up", *args, check=False)
            one_line_error(p)
            assert why in p.stderr and "must not overlap" in p.stderr, (args, p.stderr)
        assert n.pid() is None
    finally:
        n.stop()


def test_bad_settings_are_refused_with_key_value_and_source(tmp_path):
    n = AcacheNode(tmp_path)
    cfg = tmp_path / "c.toml"
    try:
        for text, want in (("chunk_size = 0\n", "line 1: chunk_size = 0: "),
                           ("engine = 'auto'\ncache_size = 1.5\n", "line 2: cache_size = 1.5: "),
                           ("stall_timeout = nan\n", "stall_timeout = nan: "),
                           ('log_level = "LOUD"\n', "log_level = 'LOUD': ")):
            cfg.write_text(text)
            p = n.cli("up", "--config", str(cfg), check=False)
            one_line_error(p)
            assert f"config file {cfg}" in p.stderr and want in p.stderr, p.stderr
        cfg.write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00\xff\xfe")
        p = n.cli("up", "--config", str(cfg), check=False)
        one_line_error(p)
        assert f"config file {cfg}: not a TOML text file" in p.stderr, p.stderr
        n.env["ACACHE_UFS"] = "mem://volatile"
        p = n.cli("up", check=False)
        one_line_error(p)
        assert "environment ACACHE_UFS: ufs = 'mem://volatile'" in p.stderr, p.stderr
        del n.env["ACACHE_UFS"]
        p = n.cli("up", "--ufs", "s3://Not_A_Bucket/p", check=False)
        one_line_error(p)
        assert "--ufs" in p.stderr and "not a valid bucket name" in p.stderr, p.stderr
        assert n.pid() is None
    finally:
        n.stop()


def test_cache_size_over_the_disk_warns_and_negative_timeouts_are_refused(tmp_path):
    st = os.statvfs(tmp_path)
    too_big = st.f_blocks * st.f_frsize * 2
    n = AcacheNode(tmp_path, extra_env={"ACACHE_CACHE_SIZE": str(too_big)})
    try:
        p = n.cli("up")
        assert f"cache_size = {too_big} (environment ACACHE_CACHE_SIZE) is larger than" in p.stderr
        assert "is larger than the whole filesystem" in (n.home / "acache.log").read_text()
        for args in (["flush", "--wait", "--timeout", "-3"], ["flush", "--timeout", "nan"],
                     ["down", "--timeout", "-1"]):
            p = n.cli(*args, check=False)
            one_line_error(p)
            assert "--timeout" in p.stderr and "finite number of seconds >= 0" in p.stderr
        p = n.cli("flush", "--timeout", "soon", check=False)   # not a number: a usage error
        one_line_error(p)
        assert p.returncode == 2 and "'--timeout'" in p.stderr, p.stderr
        assert n.pid() is not None                      # the refused `down` left it running
    finally:
        n.stop()


def test_control_socket_is_bounded_and_survives_garbage(tmp_path):
    n = AcacheNode(tmp_path)
    conns: list[socket.socket] = []
    try:
        n.cli("up")
        pid = n.pid()
        before = _threads(pid)
        sock = str(n.home / "acache.sock")
        for _ in range(1000):                           # idle: connect, send nothing
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(sock)
            conns.append(s)
        st = n.status()                                 # still answered
        assert st["pid"] == pid
        assert _threads(pid) <= before + 2, f"{_threads(pid)} threads, {before} before"
        for c in conns:
            c.close()
        conns.clear()

        def send_raw(payload: bytes) -> dict:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(30)
                s.connect(sock)
                s.sendall(payload)
                head = s.recv(4, socket.MSG_WAITALL)
                body = s.recv(struct.unpack(">I", head)[0], socket.MSG_WAITALL)
                return msgpack.unpackb(body)
        rss0 = _rss(pid)
        stalled = []
        for _ in range(8):                              # 8 frames announcing 60 MiB each
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)
            s.connect(sock)
            s.sendall(struct.pack(">I", 60 << 20) + b"\x00" * 4096)   # and stalls
            stalled.append(s)
        for s in stalled:                               # refused at the header
            head = s.recv(4, socket.MSG_WAITALL)
            rep = msgpack.unpackb(s.recv(struct.unpack(">I", head)[0], socket.MSG_WAITALL))
            assert "too large" in rep["error"], rep
            s.close()
        rss1 = _rss(pid)
        assert rss1 - rss0 < 64 << 20, f"RSS grew by {(rss1 - rss0) >> 20} MiB"
        for body in (b"\xc1\xc1\xc1", msgpack.packb([1, 2]), msgpack.packb("status"),
                     msgpack.packb({"op": "status", "path": 3})):
            rep = send_raw(struct.pack(">I", len(body)) + body)
            assert "bad request" in rep["error"], rep
        assert n.status()["pid"] == pid                 # the node keeps serving
        deadline = time.monotonic() + 30
        while _threads(pid) > before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        log = (n.home / "acache.log").read_text()
        assert "Traceback" not in log, log[-3000:]
        assert log.count("control socket: bad request") == 8 + 4, log[-3000:]   # a line each
    finally:
        for c in conns:
            c.close()
        n.stop()


def test_down_no_flush_names_the_cache_dir_in_use(make_node, tmp_path):
    n = make_node(start=False, flush_delay=3600)        # closed files stay dirty
    cache = tmp_path / "elsewhere-cache"
    n.cli("up", "--cache-dir", str(cache))
    n.cli("mount", str(n.mnt))
    (n.mnt / "dirty.bin").write_bytes(b"d" * 4096)
    p = n.cli("down", "--no-flush")
    assert "warning" in p.stderr and f"stay dirty in {cache};" in p.stderr, p.stderr
    assert str(n.home / "cache") not in p.stderr
