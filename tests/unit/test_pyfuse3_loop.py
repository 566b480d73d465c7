"""The pyfuse3 engine's request loop never sleeps in read(/dev/fuse) with the trio loop
inside it (the lost wakeup behind stalls of minutes with io_uring I/O in flight).

The kernel can take back what made /dev/fuse readable between the loop's readiness
check and its read: a queued INTERRUPT when its request is answered, a queued request
when its caller is killed.  This stages the second one deterministically on a real
mount of acache's own VFS: the trio thread is held in a callback of its entry queue in
the same batch as the reader that the readiness woke; meanwhile the request's caller is
SIGKILLed.  Then an answer computed in a worker thread (a getxattr that waited for the
metadata lock) must still reach its caller.  pyfuse3 reads with the GIL held, so a loop
asleep in read() freezes this whole process: a helper process of its own waits for the
test to report each trial done and otherwise, after 30 s, is the "unrelated request"
that wakes the loop -- and the trial fails.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from acache.data.cache import CacheDir
from acache.data.persister import Persister
from acache.data.under.mem import MemStore
from acache.fs import pyfuse3_loop
from acache.fs.pyfuse3_engine import Pyfuse3Engine
from acache.fs.vfs import VFS
from acache.meta.kv_mem import MemKV
from acache.meta.store import MetaStore

try:
    from .native_fixtures import NATIVE_MARKS, tmp_path  # noqa: F401 (a fixture)
except ImportError:
    from native_fixtures import NATIVE_MARKS, tmp_path  # noqa: F401

pytestmark = NATIVE_MARKS


def _until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def _waiting_on_fuse(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return "request_wait_answer" in f.read()
    except FileNotFoundError:
        return False


def _getxattr(path: str, name: str) -> subprocess.Popen:
    code = f"import os\ntry: os.getxattr({path!r}, {name!r})\nexcept OSError: pass"
    return subprocess.Popen([sys.executable, "-c", code])


def _unsticker(mnt: str, timeout: float = 30.0) -> subprocess.Popen:
    """Exits 0 when told (a byte on stdin) within ``timeout``; else sends one request to
    the mount (which wakes a loop asleep in read()) and exits 1."""
    code = (f"import os, select, sys\n"
            f"if select.select([sys.stdin], [], [], {timeout})[0] and sys.stdin.read(1):\n"
            f"    sys.exit(0)\n"
            f"try: os.getxattr({mnt!r}, 'user.unstick')\n"
            f"except OSError: pass\n"
            f"sys.exit(1)\n")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)


def _answered(proc: subprocess.Popen, mnt: str, trial: int) -> None:
    """``proc`` ends within 20 s (a hang detector, not a timing bound)."""
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        # unstick the loop (any new request does) so that the mount can stop
        _getxattr(mnt, "user.unstick").wait()
        proc.wait(timeout=20)
        pytest.fail(f"trial {trial}: an answer waited for an unrelated request "
                    "(the loop slept in read(/dev/fuse))")


@pytest.fixture
def mounted(tmp_path):
    meta = MetaStore(MemKV())
    cache = CacheDir(str(tmp_path / "cache"), 1 << 30, 5)
    store = MemStore("mem://pyfuse3-loop")
    persister = Persister(meta, cache, store, flush_delay=3600.0, concurrency=1)
    vfs = VFS(meta, cache, store, persister, chunk_size=1 << 20)
    vfs.recover()
    mnt = str(tmp_path / "mnt")
    os.makedirs(mnt)
    before = pyfuse3_loop.fuse_fds()
    eng = Pyfuse3Engine(vfs, mnt)
    eng.start()
    (devfd,) = pyfuse3_loop.fuse_fds() - before
    with open(os.path.join(mnt, "f"), "wb") as f:
        f.write(b"x")
    yield vfs, eng, mnt, devfd
    eng.stop()
    assert not os.path.ismount(mnt)


def _trial(vfs, token, mnt: str, devfd: int, trial: int) -> bool:
    """One attempt to stage the race; True if it was staged.  Every answer must arrive."""
    unsticker = _unsticker(mnt)
    # a request answered by a worker thread once the lock is free again
    with vfs.lock:
        waiter = _getxattr(os.path.join(mnt, "f"), "user.acache.state")
        _until(lambda: _waiting_on_fuse(waiter.pid), "the getxattr to reach the daemon")
        _until(lambda: not pyfuse3_loop.readable_now(devfd), "the daemon to read it")
        held0, free0 = threading.Event(), threading.Event()
        held1, free1 = threading.Event(), threading.Event()
        token.run_sync_soon(lambda: (held0.set(), free0.wait(10)))
        _until(held0.is_set, "the trio thread to be held")
        victim = _getxattr(mnt, "user.anything")     # queued: nobody reads now
        _until(lambda: pyfuse3_loop.readable_now(devfd), "the victim's request")
        token.run_sync_soon(lambda: (held1.set(), free1.wait(10)))
        free0.set()
        _until(held1.is_set, "the second hold")
        # the reader woken by the victim's request runs in this batch, after us
        # (or it ran before us and read it: then this trial stages nothing)
        staged = pyfuse3_loop.readable_now(devfd)
        victim.send_signal(signal.SIGKILL)   # a queued request of a killed caller is dropped
        if staged:
            _until(lambda: not pyfuse3_loop.readable_now(devfd), "the request to go")
        free1.set()
    # both callers get their answers (the waiter's is computed by a worker thread)
    _answered(victim, mnt, trial)
    _answered(waiter, mnt, trial)
    try:
        unsticker.communicate(b"k", timeout=20)
    except (BrokenPipeError, subprocess.TimeoutExpired):
        pass
    assert unsticker.wait(timeout=20) == 0, \
        f"trial {trial}: answers waited for an unrelated request (the loop slept in read())"
    return staged


def test_a_request_taken_back_never_stalls_the_loop(mounted):
    vfs, eng, mnt, devfd = mounted
    staged = 0
    for trial in range(40):
        staged += _trial(vfs, eng._token, mnt, devfd, trial)
        if staged >= 3:
            break
    assert staged >= 3, "the race was never staged"
