"""Session-wide safety nets:

* a test that crashes before its teardown must not leave a dead FUSE mount behind
  (pytest's temp-dir cleanup would block on it);
* with ACACHE_TEST_REQUIRE_ALL=1 (CI: scripts/test sets it) a skip is a failure: a run
  without torch, moto, fio or /dev/fuse must not come out green.
"""
import os
import subprocess

import pytest

pytest_plugins = ["tests.etcd_server"]     # etcd1 / etcd3 / etcd_name: real etcd members

REQUIRE_ALL = os.environ.get("ACACHE_TEST_REQUIRE_ALL", "0") == "1"


def _no_skips(rep) -> None:
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
