"""Case 7: stress-ng's metadata stressors, the way issue 10 measured them: one worker,
``--temp-path`` on the target, 10 s each; the figure is stress-ng's own bogo-ops/s (real
time) from its ``--yaml`` metrics.

    rename   renames one file round a directory
    open     opens and closes files (several flag combinations)
    utime    utime/utimes/futimens on one file
    dentry   creates and unlinks many names (dentry cache churn)
    dir      mkdir/rmdir

Runnable alone: ``python -m bench.stressng DIR [SECONDS]`` prints the ops/s as JSON."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

STRESSORS = ("rename", "open", "utime", "dentry", "dir")
LABELS = {s: f"stress-ng {s}" for s in STRESSORS}


def available() -> bool:
    return shutil.which("stress-ng") is not None


def _bogo_real(yaml_text: str, stressor: str) -> float:
    """bogo-ops-per-second-real-time of ``stressor`` in stress-ng's --yaml output (parsed by
    hand: two-space YAML, no PyYAML needed)."""
    cur = None
    for line in yaml_text.splitlines():
        s = line.strip()
        if s.startswith("- stressor:"):
            cur = s.split(":", 1)[1].strip()
        elif cur == stressor and s.startswith("bogo-ops-per-second-real-time:"):
            return float(s.split(":", 1)[1])
    raise RuntimeError(f"stress-ng printed no bogo-ops/s for {stressor}")


def run_stressor(d: Path, stressor: str, seconds: float = 10) -> float:
    """bogo-ops/s (real time) of one ``stressor`` worker with its files under ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="acb-sng-") as tmp:
        out = Path(tmp) / "metrics.yaml"
        # cwd: the open stressor leaves a file in its working directory
        p = subprocess.run(["stress-ng", f"--{stressor}", "1", "--timeout", f"{seconds:g}s",
                            "--temp-path", str(d), "--metrics-brief", "--yaml", str(out)],
                           capture_output=True, text=True, timeout=seconds + 120, cwd=d)
        if p.returncode != 0:
            tail = (p.stderr.strip() or p.stdout.strip()).splitlines()[-1:] or [""]
            raise RuntimeError(f"stress-ng --{stressor} exited {p.returncode}: {tail[0]}")
        return _bogo_real(out.read_text(), stressor)


def run_all(d: Path, seconds: float = 10, stressors=STRESSORS, log=None) -> dict[str, float]:
    out = {}
    for s in stressors:
        out[s] = run_stressor(d, s, seconds)
        if log is not None:
            log(s, out[s])
    return out


if __name__ == "__main__":
    print(json.dumps(run_all(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 10,
                             log=lambda s, v: print(f"{s}: {v:,.0f} bogo ops/s", file=sys.stderr))))
