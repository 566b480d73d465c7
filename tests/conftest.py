"""Session-wide safety net: a test that crashes before its teardown must not leave a
dead FUSE mount behind (pytest's temp-dir cleanup would block on it)."""
import subprocess


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
