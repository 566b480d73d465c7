"""Session-wide safety net: a test that crashes before its teardown must not leave a
dead FUSE mount behind (pytest's temp-dir cleanup would block on it)."""
import subprocess


def _acache_mounts() -> list[str]:
    with open("/proc/mounts") as f:
        return [ln.split()[1] for ln in f
                if ln.split()[2].startswith("fuse.acache") and "/pytest-of-" in ln.split()[1]]


def pytest_sessionfinish(session, exitstatus):
    left = _acache_mounts()
    for mnt in left:
        subprocess.run(["umount", "-l", mnt], capture_output=True)
    if left:
        print(f"\nWARNING: {len(left)} acache mounts were left behind by tests and detached: {left}")
