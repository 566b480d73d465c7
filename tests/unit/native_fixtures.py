"""What every native-engine mount test module shares: its marks, and a private temp dir."""
from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import pytest

from acache.fs.native import mount as native_mount

NATIVE_MARKS = [
    pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                       reason="needs root and /dev/fuse"),
    pytest.mark.timeout(120),
]


@pytest.fixture
def tmp_path():
    """A private temp dir: pytest's own tmp dirs are pruned by *other* pytest sessions
    running at the same time, and that rm -rf would walk into our live mounts."""
    d = tempfile.mkdtemp(prefix="acache-native-test-")
    yield pathlib.Path(d)
    with open("/proc/self/mounts") as f:
        left = [line.split()[1] for line in f if line.split()[1].startswith(d + "/")]
    for mnt in reversed(left):                      # a test that failed half-way
        native_mount.umount(mnt, lazy=True)
    shutil.rmtree(d, ignore_errors=True)
