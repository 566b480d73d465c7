"""Two network namespaces joined by a veth pair, for transport tests and scripts/bench_net.

    with VethPair() as link:          # link.a / link.b: namespaces, link.dev_a / dev_b, link.ip_a / ip_b
        proc = link.spawn("a", [sys.executable, "-m", "tests.net_peer", ...])
        link.run_in("b", client_fn, args...)   # on a thread (and its children) inside b

Needs root.  Everything made is deleted on exit (deleting a namespace deletes its veth end).
"""
from __future__ import annotations

import ctypes
import os
import select
import subprocess
import threading

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _run(*args: str) -> None:
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")


def setns(path: str) -> None:
    """Move the calling thread into the network namespace at ``path`` (threads it starts later
    are born there too)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"setns {path}: {os.strerror(e)}")
    finally:
        os.close(fd)


class VethPair:
    def __init__(self, tag: str = "", subnet: str = "10.213.7") -> None:
        tag = tag or str(os.getpid() % 100000)
        self.a, self.b = f"acn{tag}a", f"acn{tag}b"
        self.dev_a, self.dev_b = f"acv{tag}a", f"acv{tag}b"
        self.ip_a, self.ip_b = f"{subnet}.1", f"{subnet}.2"
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    def __enter__(self) -> VethPair:
        try:
            for ns in (self.a, self.b):
                _run("ip", "netns", "add", ns)
                self._made.append(ns)
            _run("ip", "link", "add", self.dev_a, "netns", self.a, "type", "veth",
                 "peer", "name", self.dev_b, "netns", self.b)
            for ns, dev, ip in ((self.a, self.dev_a, self.ip_a), (self.b, self.dev_b, self.ip_b)):
                _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    def ns(self, side: str) -> str:
        return self.a if side == "a" else self.b

    def dev(self, side: str) -> str:
        return self.dev_a if side == "a" else self.dev_b

    def ip(self, side: str, *args: str) -> None:
        """``ip -n <ns> ARGS``, e.g. link.ip("b", "link", "set", link.dev_b, "down")."""
        _run("ip", "-n", self.ns(side), *args)

    def tc(self, side: str, *args: str) -> None:
        _run("ip", "netns", "exec", self.ns(side), "tc", *args)

    def spawn(self, side: str, argv: list[str], ready_within: float = 20.0) -> tuple[subprocess.Popen, str]:
        """Start ``argv`` in a namespace; wait for its "READY <address>" line."""
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(side), *argv], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(
                                 os.path.abspath(__file__))))
        self._procs.append(p)
        assert p.stdout is not None
        r, _, _ = select.select([p.stdout], [], [], ready_within)
        line = p.stdout.readline() if r else ""
        if not line.startswith("READY "):
            p.kill()
            err = p.stderr.read() if p.stderr else ""
            raise RuntimeError(f"{argv}: no READY line within {ready_within}s: {line!r} {err[-2000:]}")
        return p, line.split()[1]

    def run_in(self, side: str, fn, *args, timeout: float = 300.0):
        """``fn(*args)`` on a new thread living in the namespace (threads it starts live there
        too; nothing else of this process moves); its result, or its exception re-raised."""
        return run_in_netns(f"/run/netns/{self.ns(side)}", fn, *args, timeout=timeout)


def run_in_netns(path: str, fn, *args, timeout: float = 300.0):
    """``fn(*args)`` on a new thread moved into the network namespace at ``path`` (sockets it
    opens, and threads it starts, live there; nothing else of this process moves); its
    result, or its exception re-raised."""
    out: dict = {}

    def body() -> None:
        try:
            setns(path)
            out["r"] = fn(*args)
        except BaseException as e:  # noqa: B036 - handed to the caller
            out["e"] = e
    t = threading.Thread(target=body, name=f"in-netns-{os.path.basename(path)}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} still running in {path} after {timeout}s")
    if "e" in out:
        raise out["e"]
    return out.get("r")
