"""scripts/demo (acache.demo) end to end, tiny sizes: its own node + mount in a temp
ACACHE_HOME, a table, a byte-identical copy in the under-storage, nothing left behind."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the demo needs torch (pip install -e .[torch])")

from tests.acache_node import fuse_mounts  # noqa: E402
from tests.e2e.conftest import ENGINES  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.torch]
REPO = Path(__file__).resolve().parents[2]


def test_demo_runs_and_cleans_up():
    # the engine users get (auto), unless the native one is switched off for the tests
    engine = [] if "native" in ENGINES else ["--engine", "pyfuse3"]
    p = subprocess.run([str(REPO / "scripts" / "demo"), *engine, "--state-mb", "16",
                        "--steps", "4", "--save-every", "2"],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, COLUMNS="200"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "byte-identical" in p.stdout, p.stdout
    assert re.search(r"│\s+all\s+│.*\d+\.\d+x", p.stdout), p.stdout
    root = re.search(r"mount (/\S+)/mnt ", p.stdout).group(1)
    assert not [m for m in fuse_mounts() if m.startswith(root)]
    assert not os.path.exists(root), f"{root} left behind"
