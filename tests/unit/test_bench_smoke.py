"""The benchmark harness (scripts/bench) runs end to end on tiny sizes and produces a
well-formed table and JSON file. No timing is asserted: benchmarks are not tests."""
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _fuse_mounts() -> list[str]:
    with open("/proc/mounts") as f:
        return [ln.split()[1] for ln in f if ln.split()[2].startswith("fuse")]


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_bench_smoke(tmp_path):
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse") or shutil.which("fio") is None:
        pytest.skip("the harness needs root, /dev/fuse and fio")
    out = tmp_path / "res.json"
    work = tmp_path / "work"
    argv = [str(ROOT / "scripts" / "bench"), "--cases", "1,2,3,4,6", "--size", "4MiB", "--repeat", "1",
            "--meta-files", "40",
            "--engines", "pyfuse3", "--json", str(out), "--workdir", str(work)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]

    # the printed table
    for title in ("case 1: fio sequential write", "case 2: read-after-write",
                  "case 3: checkpoint stall", "case 4: persist", "case 6: metadata", "headline"):
        assert title in p.stdout, p.stdout
    for cell in ("raw disk", "acache pyfuse3", "× raw", "p99 ms"):
        assert cell in p.stdout

    # the JSON file
    doc = json.loads(out.read_text())
    assert doc["format"] == "acache-bench/1" and doc["complete"] is True
    assert doc["engines"]["pyfuse3"]["mounted"] is True
    rows = {(r["case"], r["test"], r["target"]): r for r in doc["rows"]}
    want = [(1, "write, 1 job", "raw"), (1, "write, 1 job", "acache-pyfuse3"),
            (1, "write, 4 jobs", "raw"), (1, "write, 4 jobs", "acache-pyfuse3"),
            (2, "read, 1 job", "acache-pyfuse3"), (2, "read, 4 jobs", "acache-pyfuse3"),
            (2, "DCP-like 4 KiB reads, tail first", "acache-pyfuse3"),
            (3, "torch.save", "raw"), (3, "torch.save", "s3"), (3, "torch.save", "acache-pyfuse3"),
            (3, "DCP save, 2 ranks", "dir"), (3, "DCP save, 2 ranks", "acache-pyfuse3"),
            (4, "to a directory", "cp"), (4, "to a directory", "acache-pyfuse3"),
            (4, "to S3", "upload"), (4, "to S3", "acache-pyfuse3")]
    want += [(6, test, target) for test in ("create + write 4 KiB + close", "stat", "rename",
                                            "utime", "readdir (per name)", "unlink")
             for target in ("raw", "acache-pyfuse3")]
    for key in want:
        assert key in rows, f"missing row {key}; have {sorted(rows)}"
    for key, r in rows.items():
        assert r["n"] == 1 and len(r["values"]) == 1
        v = r["median"][r["primary"]]
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, (key, r)
        if r["target"] == r["baseline"]:
            assert r["ratio"] is None
        elif r["baseline"] is not None:
            assert isinstance(r["ratio"], float) and math.isfinite(r["ratio"]) and r["ratio"] > 0, (key, r)
        for k in ("p50_ms", "p99_ms", "p999_ms"):
            if r["case"] in (1, 2):
                assert r["median"][k] >= 0
        if r["case"] == 3:
            assert isinstance(r["s3_over"], float) and r["s3_over"] > 0, (key, r)
    assert len(doc["measurements"]) == len(rows)
    heads = {(h["test"], h["target"]): h["s3_over_acache"] for h in doc["headline"]}
    assert set(heads) == {("torch.save", "acache-pyfuse3"), ("DCP save, 2 ranks", "acache-pyfuse3")}
    assert all(isinstance(v, float) and math.isfinite(v) for v in heads.values())
    assert doc["machine"]["fio"].startswith("fio")

    # everything it started is gone: no mount left, no scratch directory left
    assert not [m for m in _fuse_mounts() if m.startswith(str(work))]
    assert list(work.iterdir()) == []


def test_stressng_figure_is_its_bogo_ops_per_second_real_time():
    """Case 7 reports what issue 10 quoted: stress-ng's bogo-ops/s (real time) of the stressor
    asked for, read from its --yaml metrics."""
    from bench.stressng import _bogo_real
    text = """---
metrics:
    - stressor: open
      bogo-ops: 100
      bogo-ops-per-second-usr-sys-time: 999.0
      bogo-ops-per-second-real-time: 12.5
    - stressor: rename
      bogo-ops: 30726
      bogo-ops-per-second-usr-sys-time: 19811.377325
      bogo-ops-per-second-real-time: 10193.144177
...
"""
    assert _bogo_real(text, "rename") == pytest.approx(10193.144177)
    assert _bogo_real(text, "open") == 12.5
    with pytest.raises(RuntimeError):
        _bogo_real(text, "utime")
