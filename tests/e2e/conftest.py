import os

import pytest

from tests.acache_node import AcacheNode

ENGINES = ["pyfuse3"] + (["native"] if os.environ.get("ACACHE_TEST_NATIVE", "1") == "1" else [])


def _native_available() -> bool:
    try:
        import acache.fs.native  # noqa: F401
        return True
    except Exception:
        return False


@pytest.fixture(params=ENGINES)
def engine(request):
    if request.param == "native" and not _native_available():
        pytest.fail("the native engine does not import")
    return request.param


@pytest.fixture
def node(tmp_path, engine):
    """A running node with the mount at node.mnt over a file:// under-storage."""
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.fail("e2e tests need /dev/fuse and root")
    n = AcacheNode(tmp_path, engine=engine).start()
    yield n
    n.stop()
