"""The three ways a mount is served: pyfuse3, native with kernel passthrough, native
without it (what ``auto`` picks on kernels < 6.9).  Import ``variant`` into a test
module to run its tests on each; ``make_variant_node`` starts nodes for it."""
import os

import pytest

from tests.acache_node import AcacheNode

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
