"""--plot: scripts/demo and scripts/bench draw a PNG from a tiny run; without matplotlib the
flag fails at once with one line (no traceback)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.conftest import _need_fuse

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def _env(extra_path: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACACHE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(ROOT)) if p)
    env["MPLBACKEND"] = "Agg"
    return env


def _is_png(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 10_000 and path.read_bytes()[:8] == PNG


def test_demo_plot_from_a_tiny_run(tmp_path):
    _need_fuse()
    out = tmp_path / "stall.png"
    p = subprocess.run([sys.executable, "-m", "acache.demo", "--state-mb", "8", "--steps", "4",
                        "--save-every", "2", "--engine", "native", "--plot", str(out)],
                       env=_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"plot: {out}" in p.stdout.replace("\n", "")
    assert _is_png(out)


def test_bench_plot_from_a_tiny_run(tmp_path):
    _need_fuse()
    d = tmp_path / "plots"
    p = subprocess.run([sys.executable, "-m", "bench", "--cases", "6", "--meta-files", "20",
                        "--repeat", "1", "--engines", "native", "--no-s3", "--plot", str(d),
                        "--json", str(tmp_path / "r.json"), "--workdir", str(tmp_path / "w")],
                       env=_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert _is_png(d / "case6.png")


def test_plot_without_matplotlib_is_one_line(tmp_path):
    shim = tmp_path / "shim" / "matplotlib"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('matplotlib hidden by the test')\n")
    for argv in (["-m", "acache.demo", "--plot", str(tmp_path / "x.png")],
                 ["-m", "bench", "--cases", "6", "--plot", str(tmp_path / "d")]):
        p = subprocess.run([sys.executable, *argv], env=_env(str(tmp_path / "shim")),
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
        lines = p.stderr.strip().splitlines()
        assert p.returncode != 0, p.stdout + p.stderr
        assert len(lines) == 1 and "matplotlib" in lines[0] and "acache[plot]" in lines[0], p.stderr
        assert "Traceback" not in p.stderr
        assert not (tmp_path / "x.png").exists() and not (tmp_path / "d").exists()
