"""Processes and mounts the harness starts, and the one place that ends them.

Every child is started through ``Owned.spawn`` (its own session, so a Ctrl-C in the terminal
reaches only the harness, which then tears down in order; and PR_SET_PDEATHSIG, so a child
outlives the harness only if the harness itself is SIGKILLed *and* the child ignores SIGTERM).
``Owned.close`` unmounts what was mounted, then ends every child by its pid.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child, between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except Exception:
        pass


def fuse_mounts() -> list[str]:
    with open("/proc/mounts") as f:
        rows = [ln.split() for ln in f]
    return [r[1].replace("\\040", " ") for r in rows if len(r) > 2 and r[2].startswith("fuse")]


def is_mounted(path: str | Path) -> bool:
    return os.path.abspath(path) in fuse_mounts()


def detach(path: str | Path) -> None:
    """Lazily detach a FUSE mount (alive or dead) if it is still there."""
    p = os.path.abspath(path)
    if not is_mounted(p):
        return
    for cmd in (["fusermount3", "-u", "-z", p], ["umount", "-l", p]):
        try:
            subprocess.run(cmd, capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if not is_mounted(p):
            return


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL — this one process, by its pid."""
    if proc.poll() is not None:
        return
    try:
        proc.terminate()
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
    except ProcessLookupError:
        pass


class Owned:
    """What this harness started: child processes, mount points, and undo steps (LIFO)."""

    def __init__(self) -> None:
        self._undo: list[tuple[str, object]] = []

    def spawn(self, argv: list[str], **kw) -> subprocess.Popen:
        kw.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(argv, start_new_session=True, preexec_fn=_die_with_parent, **kw)
        self._undo.append(("proc", proc))
        return proc

    def mounted(self, path: str | Path) -> None:
        self._undo.append(("mount", os.path.abspath(path)))

    def on_close(self, fn) -> None:
        self._undo.append(("call", fn))

    def release(self, proc: subprocess.Popen) -> None:
        """Stop one child now (and forget it)."""
        stop_process(proc)
        self._undo = [u for u in self._undo if u[1] is not proc]

    def close(self) -> list[str]:
        """Undo everything, newest first; never raises. Returns what went wrong."""
        problems = []
        while self._undo:
            kind, what = self._undo.pop()
            try:
                if kind == "proc":
                    stop_process(what)
                elif kind == "mount":
                    detach(what)
                    if is_mounted(what):
                        problems.append(f"could not detach {what}")
                else:
                    what()
            except BaseException as e:  # keep tearing down whatever happens
                problems.append(f"teardown {kind}: {type(e).__name__}: {e}")
        return problems


def drop_caches() -> bool:
    """Write dirty pages, then drop the page cache (needs root). False if not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def wait_for(pred, timeout: float, what: str, step: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(step)
