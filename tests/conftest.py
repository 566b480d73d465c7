"""Session-wide safety nets:

* a test that crashes before its teardown must not leave a dead FUSE mount behind
  (pytest's temp-dir cleanup would block on it);
* with ACACHE_TEST_REQUIRE_ALL=1 (CI: scripts/test sets it) a skip is a failure: a run
  without torch, moto, fio or /dev/fuse must not come out green;
* tests marked ``rdma`` need an RDMA device: where there is none they skip, with the reason,
  and that skip is no failure even under ACACHE_TEST_REQUIRE_ALL=1 — CI runs them in the
  soft-RoCE VM in a step of their own (scripts/test_rdma), which sets ACACHE_TEST_RDMA=1:
  there a missing device fails like any other skip.
"""
import os
import subprocess

import pytest

pytest_plugins = ["tests.etcd_server"]     # etcd1 / etcd3 / etcd_name: real etcd members

REQUIRE_ALL = os.environ.get("ACACHE_TEST_REQUIRE_ALL", "0") == "1"
RDMA_RUN = os.environ.get("ACACHE_TEST_RDMA", "0") == "1"
RDMA_SKIP = "no RDMA device here: the rdma tests run inside the soft-RoCE VM (scripts/test_rdma)"


def pytest_runtest_setup(item):
    if item.get_closest_marker("rdma") is not None:
        from acache.net.rdma import local_devices
        if not local_devices():
            pytest.skip(RDMA_SKIP)


def _no_skips(rep) -> None:
    if not RDMA_RUN and rep.skipped and RDMA_SKIP in str(rep.longrepr):
        return                 # the VM step runs these
    if REQUIRE_ALL and rep.skipped and not hasattr(rep, "wasxfail"):
        why = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"skipped ({why}), but ACACHE_TEST_REQUIRE_ALL=1 allows no skip"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _no_skips(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _no_skips(outcome.get_result())


def _acache_mounts(under: str) -> list[str]:
    with open("/proc/mounts") as f:
        return [ln.split()[1] for ln in f
                if ln.split()[2].startswith("fuse.acache") and ln.split()[1].startswith(under)]


def pytest_sessionfinish(session, exitstatus):
    # only this session's temp dir: other pytest sessions may be running on this host
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None:
        return
    left = _acache_mounts(str(factory.getbasetemp()) + "/")
    for mnt in left:
        subprocess.run(["umount", "-l", mnt], capture_output=True)
    if left:
        print(f"\nWARNING: {len(left)} acache mounts were left behind by tests and detached: {left}")
