"""The model-based random-operation test (tests/e2e/test_model.py) against two mounts of one
cluster, checked against one model.

The single-host Runner does the work -- the seeded generator, the in-memory model, the
comparison of results, errnos, contents and listings, the checkpoints where everything is
closed, `flush --wait` runs and the under-storage must equal the model exactly.  Here every
operation runs on a randomly chosen mount of the two (a second generator, so a seed gives
the same operations as on one host), descriptors are kept across steps on both nodes, and the
flushes run from either node.  What the model adds for a cluster:

1. **One writer per file across the cluster** (EBUSY).  Every kept descriptor is open for
   writing, so opening a file for writing (create of an existing file, open, truncate by path)
   on one node while the other node holds a descriptor of it must fail with EBUSY; on the
   node holding it, it succeeds as on one host.
2. **Close-to-open.**  A file's content and size are checked through an open that starts now
   (open, then fstat, a stat of the path and a read: the open drops the kernel's cached
   attributes), which reads what the last close on any node left -- except while the other
   node has the file open for writing: then the open and the read must succeed, but what they
   see is not checked (the writer's bytes are in flight).  Descriptors are read (pread) only
   on the node that writes through them.
3. **Names may be up to 1 s stale** in a node's kernel (the entry timeout; neither engine
   invalidates entries on other nodes' changes yet).  Listings are not: a cluster keeps no
   directory listings in the kernel, so they are compared at once.  For names, the runner
   records every path whose object changed (removed, replaced, created) on node A, with the
   inode A sees there afterwards; before node B next resolves that path (or one above or
   below it), it waits -- polling B's lstat, with a deadline of SETTLE_TIMEOUT -- until B
   resolves it to the same inode (or not at all).  That waits for the condition itself, not
   for a guessed time, costs nothing where B had nothing cached, and fails loudly if a stale
   name outlives the kernel's timeout by far.  A directory renamed on A carries the pending
   checks of the paths below it to its new name (B's kernel moves its cached children along).

Reproduce a failure with the seed it prints (the operations and the choice of node repeat;
the persister's and the kernel's timing do not, so a replay may need a few tries); sweep many
seeds the same way:
    ACACHE_CMODEL_SEEDS=1-20 ACACHE_CMODEL_OPS=300 [ACACHE_CMODEL_DELAY=0.05] \\
        pytest tests/cluster/test_cluster_model.py -k sweep
"""
from __future__ import annotations

import errno
import os
import random
import re
import threading
import time

import pytest

from tests.cluster_local import LocalCluster
from tests.e2e.conftest import ENGINES, _need_fuse
from tests.e2e.test_model import Runner, _diff, _no_tracebacks

pytestmark = pytest.mark.usefixtures("need_fuse")
SETTLE_TIMEOUT = 5.0         # the kernel keeps a name 1 s (acache.cluster.client.ENTRY_TIMEOUT)


@pytest.fixture
def need_fuse():
    _need_fuse()


@pytest.fixture(params=ENGINES)
def engine(request):
    return request.param


class Pair:
    """What the single-host Runner calls its node: the mount of the node the current step
    runs on, the cluster's one under-storage, flushes from the current node."""

    def __init__(self, c: LocalCluster) -> None:
        self.c = c
        self.nodes = c.nodes
        self.cur = c.nodes[0]
        self.root = c.root
        self.ufs_dir = c.ufs_dir

    @property
    def mnt(self):
        return self.cur.mnt

    @property
    def env(self) -> dict:
        return self.cur.env

    def flush(self, timeout: float = 120) -> None:
        self.cur.flush(timeout=timeout)

    def ufs_files(self) -> dict[str, bytes]:
        return self.c.ufs_files()

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(f"--- {x.root.name} ---\n{x.log_tail(n)}" for x in self.nodes)


class ClusterRunner(Runner):
    REPLAY = ("ACACHE_CMODEL_SEEDS={seed} ACACHE_CMODEL_OPS={nops} ACACHE_CMODEL_DELAY={delay} "
              "pytest tests/cluster/test_cluster_model.py -k sweep")

    def __init__(self, cluster: LocalCluster, seed: int, nops: int) -> None:
        self.pair = Pair(cluster)
        super().__init__(self.pair, seed, nops)
        self.nrng = random.Random(f"node-{seed}")      # which node: apart from the ops' rng
        self.hnode: dict[int, object] = {}            # handle -> the node it is open on
        self.stale: dict[str, dict[str, int | None]] = {n.root.name: {} for n in self.pair.nodes}
        self.touched: dict[str, int | None] = {}      # path -> its inode before this step
        self.stats = {"switches": 0, "ebusy": 0, "unchecked_reads": 0, "settled": 0,
                      "settle_s": 0.0}
        self._last = None

    # -- which node ------------------------------------------------------------------
    def use(self, node) -> None:
        if self._last is not None and node is not self._last:
            self.stats["switches"] += 1
        self.pair.cur = self._last = node

    def other(self, node) -> list:
        return [n for n in self.pair.nodes if n is not node]

    def note(self, s: str) -> None:
        m = re.search(r"\(h(\d+)", s)          # an operation on a descriptor: its node
        node = self.hnode.get(int(m.group(1)), self.pair.cur) if m else self.pair.cur
        self.log.append(f"[{self.step}] {node.root.name}: {s}")

    def dispatch(self, name: str) -> None:
        self.use(self.nrng.choice(self.pair.nodes))
        self.touched = {}
        super().dispatch(name)
        self.record_changes()

    def check_tree(self) -> None:
        self.use(self.nrng.choice(self.pair.nodes))
        super().check_tree()

    def checkpoint(self, where: str) -> None:
        self.use(self.nrng.choice(self.pair.nodes))
        super().checkpoint(where)

    def start_bg_flush(self) -> None:
        self.use(self.nrng.choice(self.pair.nodes))
        super().start_bg_flush()

    # -- descriptors and the one writer ------------------------------------------------
    def new_handle(self, fd: int, mf, append=False, readable=False) -> int:
        h = super().new_handle(fd, mf, append, readable)
        self.hnode[h] = self.pair.cur
        return h

    def op_close(self, h: int | None = None) -> None:
        before = set(self.handles)
        super().op_close(h)
        for gone in before - set(self.handles):
            del self.hnode[gone]

    def writer_elsewhere(self, mf) -> object | None:
        for h, mh in self.handles.items():
            if mh.file is mf and self.hnode[h] is not self.pair.cur:
                return self.hnode[h]
        return None

    def busy(self, p: str) -> int | None:
        if self.writer_elsewhere(self.m.files[p]) is not None:
            self.stats["ebusy"] += 1
            return errno.EBUSY
        return None

    # -- close-to-open ---------------------------------------------------------------
    def check_file(self, p: str) -> None:
        mf = self.m.files.get(p)
        if mf is None:
            return
        want = bytes(mf.data)
        writer = self.writer_elsewhere(mf)

        def fresh() -> tuple[int, int, bytes]:
            with open(self.real(p), "rb") as f:
                return os.fstat(f.fileno()).st_size, os.stat(self.real(p)).st_size, f.read()
        desc = f"open+fstat+stat+read {p}"
        if writer is not None:
            self.stats["unchecked_reads"] += 1
            desc += f" (open for writing on {writer.root.name}: not compared)"
        fsize, size, got = self.do(desc, None, fresh)
        if writer is not None:
            return
        if fsize != len(want) or size != len(want):
            self.fail(f"size of {p}: fstat after open says {fsize}, stat {size}, model {len(want)}")
        if got != want:
            self.fail(f"content of {p} differs: {_diff(got, want)}")

    # -- names that may be stale on the other node ----------------------------------------
    @staticmethod
    def ident(node, p: str) -> int | None | tuple:
        """The inode ``node``'s kernel resolves p to, None if it resolves to nothing.  Not
        lstat: a name the kernel still holds for an inode deleted elsewhere gives ENOENT
        from GETATTR while an open(O_CREAT) would still use it; an O_PATH open is the name
        lookup alone."""
        try:
            fd = os.open(os.path.join(node.mnt, p), os.O_PATH | os.O_NOFOLLOW)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                return None
            return ("error", errno.errorcode.get(e.errno, e.errno))
        try:
            return os.fstat(fd).st_ino
        except OSError as e:
            return ("a name for a stale inode", errno.errorcode.get(e.errno, e.errno))
        finally:
            os.close(fd)

    def real(self, p: str) -> str:
        node = self.pair.cur
        if p:
            self.settle(node, p)
            if p not in self.touched:
                self.touched[p] = self.ident(node, p)
        return os.path.join(node.mnt, p) if p else str(node.mnt)

    def settle(self, node, p: str) -> None:
        """Before ``node`` resolves p: wait until it sees what the other node made of every
        path at, above or below p that the other node changed."""
        pending = self.stale[node.root.name]
        keys = [k for k in pending if k == p or p.startswith(k + "/") or k.startswith(p + "/")]
        for k in sorted(keys, key=lambda k: k.count("/")):
            want = pending.pop(k)
            t0 = time.monotonic()
            while (got := self.ident(node, k)) != want:
                if time.monotonic() - t0 > SETTLE_TIMEOUT:
                    self.fail(f"{node.root.name} still resolves {k!r} to {got} {SETTLE_TIMEOUT} s "
                              f"after another node made it {want} (the kernel keeps names 1 s)")
                time.sleep(0.01)
            waited = time.monotonic() - t0
            if waited > 0.005:
                self.stats["settled"] += 1
                self.stats["settle_s"] += waited

    def record_changes(self) -> None:
        node = self.pair.cur
        for p, before in self.touched.items():
            after = self.ident(node, p)
            if after == before:
                continue
            for other in self.other(node):
                pending = self.stale[other.root.name]
                if after is None:           # gone: so is everything below it
                    for k in [k for k in pending if k.startswith(p + "/")]:
                        del pending[k]
                pending[p] = after

    def renamed(self, src: str, dst: str) -> None:
        """The other node's kernel moves a renamed directory's cached children with it."""
        if src == dst:
            return
        for other in self.other(self.pair.cur):
            pending = self.stale[other.root.name]
            for k in [k for k in pending if k.startswith(dst + "/")]:
                del pending[k]
            for k in [k for k in pending if k.startswith(src + "/")]:
                pending[dst + k[len(src):]] = pending.pop(k)


def run_cluster_model(tmp_path, etcd1, engine: str, seed: int, nops: int, delay: float) -> dict:
    with LocalCluster(tmp_path, etcd1, 2, engine=engine, flush_delay=delay,
                      extra_env={"ACACHE_LOG_LEVEL": "DEBUG"}) as c:
        r = ClusterRunner(c, seed, nops)
        t0 = time.monotonic()
        r.run()
        assert r.checkpoints >= 1
        for n in c.nodes:
            _no_tracebacks(n)
        out = dict(r.stats, ops=nops, seconds=round(time.monotonic() - t0, 1))
        out["settle_s"] = round(out["settle_s"], 2)
        print(f"cluster model seed={seed} engine={engine} delay={delay}: {out}")
        return out


# (seed, ops, flush_delay) on each engine: the CI part (keep it short; sweep with the env vars)
RUNS = [(1, 200, 0.0), (2, 200, 0.05)]


@pytest.mark.e2e
@pytest.mark.parametrize("seed,nops,delay", RUNS, ids=[f"seed{s}-delay{d}" for s, _, d in RUNS])
def test_cluster_model(tmp_path, etcd1, engine, seed, nops, delay):
    run_cluster_model(tmp_path, etcd1, engine, seed, nops, delay)


def _seeds(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return out


if "ACACHE_CMODEL_SEEDS" in os.environ:      # a sweep / replay tool, collected only when asked for
    _SWEEP = _seeds(os.environ["ACACHE_CMODEL_SEEDS"])
    _DELAYS = [0.0, 0.01, 0.05, 0.2]

    @pytest.mark.e2e
    @pytest.mark.parametrize("seed", _SWEEP)
    def test_cluster_model_sweep(tmp_path, etcd1, engine, seed):
        nops = int(os.environ.get("ACACHE_CMODEL_OPS", "300"))
        delay = float(os.environ.get("ACACHE_CMODEL_DELAY", _DELAYS[seed % len(_DELAYS)]))
        run_cluster_model(tmp_path, etcd1, engine, seed, nops, delay)



# -- what the model found, each reduced to a small deterministic case ---------------------------
def test_head_reads_a_file_closed_on_another_node_before_its_release(tmp_path, etcd1, engine):
    """close(2) on B returns once its FLUSH is answered; the RELEASE follows on its own (here:
    held back by a dup of the descriptor).  Until it arrives the head counts B's write session
    as open -- and took the file's size from the head node's own cache file of that generation,
    which the head node's reader had just created empty: a read on the head right after B's
    close saw an empty file."""
    with LocalCluster(tmp_path, etcd1, 2, engine=engine) as c:
        head = c.node(c.wait_head())
        other = c.nodes[1 if head is c.nodes[0] else 0]
        data = os.urandom(100_000)
        fd = os.open(other.mnt / "f", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        os.write(fd, data)
        fd2 = os.dup(fd)
        try:
            os.close(fd)                      # FLUSH: closed and journaled; no RELEASE yet
            with open(head.mnt / "f", "rb") as f:
                assert os.fstat(f.fileno()).st_size == len(data)
                assert f.read() == data
        finally:
            os.close(fd2)
        other.flush()
        assert c.ufs_files() == {"f": data}


def test_write_open_waits_for_the_other_nodes_release(tmp_path, etcd1, engine):
    """A write open on B right after A's close(2) returned must succeed: the file is closed.
    But A's RELEASE, which ends its write session at the head, comes after the close, on its
    own, and the head answered EBUSY while it was in flight (the model met it as a spurious
    EBUSY one step after a close on the other node).  Here a dup holds A's RELEASE back for
    0.5 s, deterministically: B's open waits for it, then succeeds and reads A's bytes."""
    with LocalCluster(tmp_path, etcd1, 2, engine=engine) as c:
        a, b = c.nodes
        fd = os.open(a.mnt / "f", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        os.write(fd, b"from a")
        fd2 = os.dup(fd)
        os.close(fd)                                   # closed: FLUSH; the RELEASE waits for fd2
        t = threading.Timer(0.5, os.close, [fd2])
        t.start()
        try:
            with open(b.mnt / "f", "r+b") as f:
                assert f.read() == b"from a"
                f.write(b", then b")
        finally:
            t.join()
        assert (a.mnt / "f").read_bytes() == b"from a, then b"


def test_write_open_still_ebusy_while_other_node_may_write(tmp_path, etcd1):
    """What the wait for a RELEASE must not change: a node that closed one descriptor but holds
    a dup of it may still write, so a write open elsewhere is EBUSY (after the wait)."""
    with LocalCluster(tmp_path, etcd1, 2) as c:
        a, b = c.nodes
        fd = os.open(a.mnt / "f", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        os.write(fd, b"a")
        fd2 = os.dup(fd)
        os.close(fd)
        try:
            t0 = time.monotonic()
            with pytest.raises(OSError) as ei:
                os.open(b.mnt / "f", os.O_WRONLY)
            assert ei.value.errno == errno.EBUSY and time.monotonic() - t0 < 10
        finally:
            os.close(fd2)
        with open(b.mnt / "f", "ab") as f:           # released now: B may write
            f.write(b"c")
        assert (a.mnt / "f").read_bytes() == b"ac"


def test_read_while_another_node_writes_is_not_kept_as_the_file(tmp_path, etcd1, engine):
    """B reads a file while A writes it (what B sees then is not promised), A goes on writing
    and closes, B opens it again: B must read what A's close left.  B kept its first read as a
    copy of that generation and marked it whole, so the later open read the old bytes (and a
    read past what A's cache file held then failed with EIO, "short read")."""
    with LocalCluster(tmp_path, etcd1, 2, engine=engine) as c:
        a, b = c.nodes
        (a.mnt / "f").write_bytes(b"x" * 5000)
        with open(a.mnt / "f", "r+b") as f:
            f.write(b"y" * 100)
            f.flush()
            os.fsync(f.fileno())
            during = (b.mnt / "f").read_bytes()
            assert len(during) == 5000                 # the size A's fsync recorded
            f.truncate(10)                             # now shorter than what B was told
            f.seek(0, 2)
            f.write(b"z" * 9000)
            assert len((b.mnt / "f").read_bytes()) <= 5000    # no EIO
        want = b"y" * 10 + b"z" * 9000
        assert (b.mnt / "f").read_bytes() == want
        b.flush()
        assert c.ufs_files() == {"f": want}


def test_stat_during_the_last_release_of_a_writer(tmp_path, etcd1):
    """A GETATTR on the writing node while its last write handle is released: ClientVFS read
    the session's fd outside its lock, the release closed it meanwhile, and the stat failed
    with EIO (EBADF inside; a reused fd number would have given another file's size).  A race
    the model met once in ~6,000 operations; this stress (closes against fresh stats) has not
    caught it without the fix in the runs here -- it guards the locking, it is no reliable
    reproduction."""
    with LocalCluster(tmp_path, etcd1, 2) as c:
        a = c.nodes[0]
        errors: list[OSError] = []
        stop = threading.Event()

        def stats() -> None:
            while not stop.is_set():
                try:
                    with open(a.mnt / "f", "rb") as f:     # an open drops the cached attributes
                        os.fstat(f.fileno())
                except FileNotFoundError:
                    pass
                except OSError as e:
                    errors.append(e)
        t = threading.Thread(target=stats)
        t.start()
        try:
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline and not errors:
                with open(a.mnt / "f", "wb") as f:
                    f.write(b"x" * 4096)
        finally:
            stop.set()
            t.join()
        assert not errors, errors[:3]
