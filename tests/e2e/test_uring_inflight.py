"""io_uring I/O in flight on a file never leaves other requests on it waiting.

fio (io_uring, random read/write) runs on one file while a watchdog process keeps its
own io_uring reads of that file in flight and loops stat/getxattr/read on it: its
io_uring completions interrupt its other FUSE requests (an INTERRUPT each, often taken
back by the kernel when the request is answered first), which stalled the pyfuse3
engine (see tests/unit/test_pyfuse3_loop.py for the deterministic case).  Every call
must complete; the 30 s bound is a hang detector, not a timing assertion."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
import time

import pytest

from tests.e2e.contract_util import pattern

RUN = 20          # seconds of load
BOUND = 30.0      # no single call may take this long


REPO = str(Path(__file__).resolve().parents[2])   # -m tests.uring, whatever the cwd


def test_calls_complete_while_io_uring_io_is_in_flight(make_variant_node):
    if shutil.which("fio") is None:
        pytest.fail("fio is missing (scripts/install installs it)")
    n = make_variant_node(flush_delay=3600)
    f = n.mnt / "f"
    f.write_bytes(pattern(64 << 20, seed=3))
    fio = subprocess.Popen(["fio", "--name=inflight", "--ioengine=io_uring", "--iodepth=32",
                            "--rw=randrw", "--bs=4k", "--size=64m", "--direct=0",
                            f"--filename={f}", "--time_based", f"--runtime={RUN}"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wd = subprocess.Popen([sys.executable, "-m", "tests.uring", str(f), str(RUN), "16"], cwd=REPO,
                          stdout=subprocess.PIPE, text=True)
    try:
        out, _ = wd.communicate(timeout=RUN + BOUND)
        _, fio_err = fio.communicate(timeout=RUN + BOUND)
    except subprocess.TimeoutExpired:
        wd.kill()
        fio.kill()
        pytest.fail(f"calls on the file hung for more than {BOUND:.0f} s\n{n.log_tail()}")
    assert wd.returncode == 0, out
    assert fio.returncode == 0, fio_err
    res = json.loads(out)
    assert res["loops"] > 0 and res["uring_reads"] > 0, res
    assert max(res["worst"].values()) < BOUND, res
    assert n.status()["last_error"] in (None, ""), n.status()
    t = time.monotonic()
    os.stat(f)
    assert time.monotonic() - t < BOUND
