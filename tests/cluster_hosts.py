"""Hosts for cluster tests: network namespaces on one bridge, etcd inside them, acache nodes.

    with Hosts(3) as hosts:                      # hosts 0..2: 10.214.0.1..3/24 on eth0, lo up
        hosts.addr(1)                            # "10.214.0.2"
        p = hosts.spawn(0, argv, env=..., stdout=subprocess.PIPE)   # a Popen inside host 0
        hosts.run(0, argv)                       # the same, waited for (CompletedProcess)
        hosts.run_in(1, fn, *args)               # fn on a thread inside host 1 (plain sockets)
        hosts.link_down(2); hosts.link_up(2)     # pull / plug host 2's cable
        hosts.rate(1, "2gbit"); hosts.rate(1, None)   # shape host 1's link (both ways) / unshape
        etcd = hosts.etcd(tmp / "etcd", on=[0, 1, 2])  # a started tests.etcd_server.EtcdCluster
        etcd.endpoints                           # ["10.214.0.1:2379", ...]: from every host
        secret = write_secret(tmp / "secret")    # mode 600, the format of acache.net.auth
        a = ClusterNode(hosts, 0, tmp / "a", ufs=f"file://{shared}",
                        config={"listen": f"{hosts.addr(0)}:7470", "secret_file": secret}).start()
        a.mnt / "x"                              # the mount is visible here (see below)
        a.cli("status"); a.flush(); a.kill9(); a.restart(); a.stop()

Layout: each host is a namespace ``ach-TAG-PID-hI`` whose eth0 is a veth to port pI of the
bridge br0 in a hub namespace ``ach-TAG-PID-hub``; the root namespace's networking is not
touched (it cannot reach the hosts either).  On exit everything goes, failures included:
nodes stopped, etcd killed, spawned processes killed, then whatever still runs in the
namespaces, then the namespaces (and with them the veths and the bridge).  Entering also
removes namespaces ``ach-TAG-*`` whose creating process is dead (a killed earlier run).

Gotchas:
* Processes enter a host with ``nsenter --net=/run/netns/NAME`` (network namespace only):
  the mount namespace stays the test's, so a FUSE mount made by a node inside a host shows
  in the test's /proc/mounts and can be read and unmounted from the test.  ``ip netns exec``
  would not do: it also unshares the mount namespace (to remount /sys), and a mount made
  under it is invisible outside.
  Both engines mount with mount(2) as root (libfuse would fall back to fusermount3, which
  would run in the same two namespaces); ``umount -l`` and the FUSE connection's abort file
  (wait_gone_after_sigkill) work from the test as for a node on the root namespace.
* The control socket of a node is a path-bound unix socket: it answers from any network
  namespace, so ``AcacheNode.pid()`` works from the test.  Its TCP addresses do not.
* ``link_down`` downs the host's bridge port: the host's eth0 loses carrier, nothing is
  answered (no RST, no ICMP), so connects and reads in flight time out, as with a pulled
  cable; addresses and routes stay, and ``link_up`` restores the path as it was.
* ``run_in`` moves one thread: fine for plain sockets; gRPC (the etcd client) opens its
  connections on threads of its own, so run it in a process inside the host (``spawn``).

Needs root, iproute2 (ip, tc, bridge) and nsenter: ``need_hosts()`` skips with the reason,
or fails under ACACHE_TEST_REQUIRE_ALL=1.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.acache_node import AcacheNode
from tests.etcd_server import EtcdCluster
from tests.netns import run_in_netns

REQUIRE_ALL = os.environ.get("ACACHE_TEST_REQUIRE_ALL", "0") == "1"
REPO = Path(__file__).resolve().parent.parent
SUBNET = "10.214.0"            # each Hosts has its own bridge: runs at once do not collide


def need_hosts(fuse: bool = False) -> None:
    """Skip (fail under ACACHE_TEST_REQUIRE_ALL=1) unless namespaces can be made here."""
    missing = [t for t in ("ip", "tc", "bridge", "nsenter") if shutil.which(t) is None]
    why = ("the multi-host tests need root (network namespaces)" if os.geteuid() != 0 else
           f"the multi-host tests need {', '.join(missing)} (Debian: iproute2, util-linux)"
           if missing else
           "the multi-host node tests need /dev/fuse" if fuse and not os.path.exists("/dev/fuse")
           else None)
    if why is None:
        return
    if REQUIRE_ALL:
        pytest.fail(why + " and ACACHE_TEST_REQUIRE_ALL=1", pytrace=False)
    pytest.skip(why)


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(args, capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")
    return r


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _netns_names() -> list[str]:
    return [ln.split()[0] for ln in _run("ip", "netns", "list").stdout.splitlines() if ln.strip()]


def _reap_netns(name: str) -> None:
    """SIGKILL what still runs in namespace ``name`` (processes a harness started there), delete it."""
    pids = [int(p) for p in _run("ip", "netns", "pids", name, check=False).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _wait(lambda: not any(_pid_alive(p) for p in pids), 10, f"the processes in {name} to die")
    _run("ip", "netns", "del", name, check=False)


def _wait(cond, timeout: float, what: str, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def write_secret(path: Path) -> Path:
    """A cluster secret for ``secret_file``: 64 hex characters, mode 600 (acache.net.auth)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    os.chmod(path, 0o600)
    return path


class Hosts:
    def __init__(self, n: int, tag: str = "t") -> None:
        assert 1 <= n <= 250 and re.fullmatch(r"[a-z0-9]{1,8}", tag), (n, tag)
        self.n = n
        self.prefix = f"ach-{tag}-"
        base = f"{self.prefix}{os.getpid()}-"
        self.hub = base + "hub"
        self.names = [f"{base}h{i}" for i in range(n)]
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._nodes: list[ClusterNode] = []
        self._etcds: list[EtcdCluster] = []

    # -- life cycle ------------------------------------------------------------------
    def __enter__(self) -> Hosts:
        self.reap_stale()
        try:
            self._add_ns(self.hub)
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge", "forward_delay", "0")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                self._add_ns(ns)
                _run("ip", "-n", self.hub, "link", "add", f"p{i}", "type", "veth",
                     "peer", "name", "eth0", "netns", ns)
                _run("ip", "-n", self.hub, "link", "set", f"p{i}", "master", "br0", "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
            for i in range(self.n):
                self._wait_link(i)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self._made.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def __exit__(self, *exc) -> None:
        """Best effort at every step (a failing one does not keep the rest from running);
        the first error is raised at the end."""
        steps = [node.stop for node in self._nodes if not node.stopped]
        steps += [c.stop for c in self._etcds]
        steps += [p.kill for p in self._procs if p.poll() is None]
        steps += [lambda p=p: p.wait(10) for p in self._procs]
        steps += [lambda ns=ns: _reap_netns(ns) for ns in reversed(self._made)]
        first: BaseException | None = None
        for step in steps:
            try:
                step()
            except BaseException as e:  # noqa: B036 - re-raised below, after the rest
                first = first or e
        self._made.clear()
        self._procs.clear()
        if first is not None and exc[0] is None:
            raise first

    def reap_stale(self) -> list[str]:
        """Delete namespaces of this prefix whose creating process is dead; their names."""
        stale = []
        for ns in _netns_names():
            m = re.fullmatch(re.escape(self.prefix) + r"(\d+)-(hub|h\d+)", ns)
            if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
                _reap_netns(ns)
                stale.append(ns)
        return stale

    # -- addressing --------------------------------------------------------------------
    def addr(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def netns(self, host: int) -> str:
        """The namespace's path, for nsenter --net= and setns."""
        return f"/run/netns/{self.names[host]}"

    def enter(self, host: int) -> list[str]:
        """The argv prefix that runs a command inside ``host``'s network namespace."""
        return ["nsenter", f"--net={self.netns(host)}", "--"]

    # -- running things in a host ----------------------------------------------------------
    def spawn(self, host: int, argv: list[str], env: dict | None = None, stdout=None,
              stderr=None, stdin=None, text: bool = True) -> subprocess.Popen:
        """``argv`` inside ``host`` (its own session; killed at exit if still running); the
        Popen's pid is the command's own (nsenter execs it)."""
        p = subprocess.Popen([*self.enter(host), *argv], env=env, stdout=stdout, stderr=stderr,
                             stdin=stdin, text=text, cwd=REPO, start_new_session=True)
        self._procs.append(p)
        return p

    def run(self, host: int, argv: list[str], env: dict | None = None, timeout: float = 60,
            check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        r = subprocess.run([*self.enter(host), *argv], env=env, capture_output=True, text=True,
                           cwd=REPO, timeout=timeout, input=input)
        if check and r.returncode:
            raise AssertionError(f"host {host}: {argv} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
        return r

    def run_in(self, host: int, fn, *args, timeout: float = 60):
        """``fn(*args)`` on a thread inside ``host``: its result, or its exception re-raised."""
        return run_in_netns(self.netns(host), fn, *args, timeout=timeout)

    # -- the link --------------------------------------------------------------------------
    def link_down(self, host: int) -> None:
        """Pull the cable: the host's bridge port goes down; packets to and from it are lost."""
        _run("ip", "-n", self.hub, "link", "set", f"p{host}", "down")

    def link_up(self, host: int) -> None:
        """Plug it back; returns once both ends are up and the bridge forwards again."""
        _run("ip", "-n", self.hub, "link", "set", f"p{host}", "up")
        self._wait_link(host)

    def _wait_link(self, host: int, timeout: float = 10) -> None:
        def up() -> bool:
            eth = _run("ip", "-n", self.names[host], "-o", "link", "show", "eth0").stdout
            port = _run("bridge", "-n", self.hub, "link", "show", "dev", f"p{host}").stdout
            return "LOWER_UP" in eth and "state forwarding" in port
        _wait(up, timeout, f"host {host}'s link to come up")

    def rate(self, host: int, rate: str | None) -> None:
        """Shape ``host``'s link to ``rate`` (tc units: "2gbit", "100mbit") in both directions
        (tbf on the host's eth0 and on its bridge port); None removes the shaping."""
        for ns, dev in ((self.names[host], "eth0"), (self.hub, f"p{host}")):
            if rate is None:
                _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            else:
                # a burst of >= 1 ms at the rate, and never below a 64 KiB GSO super-packet
                _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", str(max(_bits(rate) // 8000, 256 << 10)), "latency", "100ms")

    # -- etcd --------------------------------------------------------------------------------
    def etcd(self, root: Path, on: list[int], start: bool = True) -> EtcdCluster:
        """An etcd cluster with one member on each host in ``on`` (at ADDR:2379, peers :2380),
        killed at exit; ``.endpoints`` work from every host."""
        c = EtcdCluster(Path(root), len(on), where=[(self.addr(h), self.netns(h)) for h in on])
        self._etcds.append(c)
        if start:
            c.start()
        return c


def _bits(rate: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)", rate.strip().lower())
    assert m, f"rate {rate!r}: expected e.g. 2gbit, 100mbit"
    n = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return int(n * (8 if m.group(3) == "bps" else 1))


def toml_lines(config: dict) -> str:
    """Flat config keys as TOML lines (strings, paths, numbers, booleans)."""
    out = []
    for k, v in config.items():
        if isinstance(v, bool):
            v = "true" if v else "false"
        elif isinstance(v, (int, float)):
            v = repr(v)
        else:
            v = json.dumps(str(v))      # a JSON string is a TOML basic string
        out.append(f"{k} = {v}")
    return "\n".join(out) + "\n"


class ClusterNode(AcacheNode):
    """An acache node living in host ``host``: its daemon, and every CLI call, run inside the
    host's network namespace; its own ACACHE_HOME (root/home: config, socket, log; the cache
    and its RocksDB in home/cache), mount point root/mnt, the under-storage ``ufs`` (a shared
    file:// directory, as NFS would be).  ``config``: extra keys for config.toml (e.g. meta,
    listen, advertise, secret_file); ``extra``: raw TOML appended.  Stopped at Hosts exit."""

    def __init__(self, hosts: Hosts, host: int, root: Path, ufs: str, *,
                 config: dict | None = None, extra: str = "", engine: str = "pyfuse3",
                 flush_delay: float = 0.2, extra_env: dict | None = None) -> None:
        super().__init__(root, engine=engine, ufs=ufs, flush_delay=flush_delay,
                         extra_env=extra_env, config=toml_lines(config or {}) + extra)
        if ufs.startswith("file://"):
            self.ufs_dir = Path(ufs.removeprefix("file://"))
        self.hosts, self.host = hosts, host
        self.argv_prefix = hosts.enter(host)
        self.stopped = True          # nothing to stop at Hosts exit until started
        hosts._nodes.append(self)

    def start(self) -> ClusterNode:
        self.stopped = False
        return super().start()

    def restart(self) -> None:
        self.stopped = False
        super().restart()

    def stop(self) -> None:
        super().stop()
        self.stopped = True

    @property
    def addr(self) -> str:
        return self.hosts.addr(self.host)
