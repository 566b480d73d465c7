import os
import re

import pytest

from tests.acache_node import AcacheNode, files_under, fuse_mounts

# Engine modes: "native-nopt" is the native engine without kernel passthrough (the engine
# `auto` picks on kernels < 6.9; AcacheNode maps it to engine=native + ACACHE_PASSTHROUGH=0).
# ENGINES: the modes every e2e suite runs on; ALL_ENGINES adds native-nopt for the suites that
# must cover it (crash, model, contract, S3), which use the `engine`/`space` fixtures.
_NATIVE = os.environ.get("ACACHE_TEST_NATIVE", "1") == "1"
ENGINES = ["pyfuse3"] + (["native"] if _NATIVE else [])
ALL_ENGINES = ENGINES + (["native-nopt"] if _NATIVE else [])


def _native_available() -> bool:
    try:
        import acache.fs.native  # noqa: F401
        return True
    except Exception:
        return False


def _engine(request):
    if request.param.startswith("native") and not _native_available():
        pytest.fail("the native engine does not import")
    return request.param


def engine_fixture(modes: list[str]):
    """An ``engine`` fixture over ``modes``: a module that runs on fewer engine modes
    (to keep CI time) says ``engine = engine_fixture(ENGINES)``."""
    return pytest.fixture(params=modes, name="engine")(_engine)


engine = engine_fixture(ALL_ENGINES)


def _need_fuse() -> None:
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.fail("e2e tests need /dev/fuse and root")


@pytest.fixture
def node(tmp_path, engine):
    """A running node with the mount at node.mnt over a file:// under-storage."""
    _need_fuse()
    n = AcacheNode(tmp_path, engine=engine).start()
    yield n
    n.stop()
    assert str(n.mnt) not in fuse_mounts(), f"{n.mnt} is still mounted after the test"


@pytest.fixture
def make_node(tmp_path, engine):
    """A factory of nodes (AcacheNode keyword arguments; ``start=False`` to prepare the
    under-storage first); every node is stopped and its mount checked gone at teardown."""
    _need_fuse()
    nodes: list[AcacheNode] = []

    def make(start: bool = True, **kw) -> AcacheNode:
        n = AcacheNode(tmp_path / f"n{len(nodes)}", engine=engine, **kw)
        nodes.append(n)
        return n.start() if start else n
    yield make
    for n in nodes:
        n.stop()
    left = [m for m in fuse_mounts() if m.startswith(str(tmp_path))]
    assert not left, f"mounts left behind: {left}"


@pytest.fixture(scope="module", params=ALL_ENGINES)
def shared_node(request, tmp_path_factory):
    """One node + mount for a whole test module (per engine): tests that need no
    special settings use a directory of it each (the ``space`` fixture)."""
    _need_fuse()
    if request.param.startswith("native") and not _native_available():
        pytest.fail("the native engine does not import")
    n = AcacheNode(tmp_path_factory.mktemp("shared"), engine=request.param).start()
    yield n
    n.stop()
    assert str(n.mnt) not in fuse_mounts(), f"{n.mnt} is still mounted after the tests"


class Space:
    """A test's own directory on a shared node; paths and the barrier are scoped to it."""

    def __init__(self, node: AcacheNode, name: str) -> None:
        self.node, self.name = node, name
        self.mnt = node.mnt / name
        self.ufs_dir = node.ufs_dir / name
        self.mnt.mkdir()

    def flush(self, timeout: float = 120) -> None:
        """`acache flush --wait <this directory>`."""
        self.node.flush(str(self.mnt), timeout=timeout)

    def ufs_files(self) -> dict[str, bytes]:
        return files_under(self.ufs_dir)

    def cli(self, *args, **kw):
        return self.node.cli(*args, **kw)

    def status(self, path: str | None = None) -> dict:
        return self.node.status(path)


@pytest.fixture
def space(shared_node, request):
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[:120]
    return Space(shared_node, name)


# The three ways a mount is served: pyfuse3, native with kernel passthrough, native without
# it (what ``auto`` picks on kernels < 6.9).  Tests taking ``make_variant_node`` run on each.
VARIANTS = {"pyfuse3": ("pyfuse3", {}),
            "native": ("native", {"ACACHE_PASSTHROUGH": "true"}),
            "native-nopt": ("native", {"ACACHE_PASSTHROUGH": "false"})}


@pytest.fixture(params=list(VARIANTS))
def variant(request):
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.fail("e2e tests need /dev/fuse and root")
    return request.param


@pytest.fixture
def make_variant_node(tmp_path, variant):
    """A factory of nodes of this variant (AcacheNode keywords); all stopped at teardown."""
    nodes: list[AcacheNode] = []

    def make(start: bool = True, **kw) -> AcacheNode:
        engine, env = VARIANTS[variant]
        n = AcacheNode(tmp_path / f"n{len(nodes)}", engine=engine,
                       extra_env={**env, **kw.pop("extra_env", {})}, **kw)
        nodes.append(n)
        return n.start() if start else n
    yield make
    for n in nodes:
        n.stop()
        assert not os.path.ismount(n.mnt), f"{n.mnt} is still mounted"
