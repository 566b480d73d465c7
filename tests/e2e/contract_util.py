"""Small helpers shared by the contract tests (tests/e2e/test_contract_*.py)."""
from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

TMP_PREFIX = ".acache-tmp."


def pattern(n: int, seed: int = 0) -> bytes:
    """``n`` bytes that differ at every offset (so misplaced or zeroed ranges show)."""
    block = hashlib.sha256(f"acache-{seed}".encode()).digest() * 2048   # 64 KiB
    reps = n // len(block) + 1
    out = bytearray(block * reps)[:n]
    for off in range(0, n, 4096):       # stamp the offset into every 4 KiB
        out[off:off + 8] = off.to_bytes(8, "little")[: max(0, min(8, n - off))]
    return bytes(out)


def ufs_names(ufs_dir: Path) -> dict[str, int]:
    """What a file:// under-storage shows now: relative path -> size (temp names hidden).
    Tolerates files vanishing while it walks."""
    out = {}
    for root, dirs, files in os.walk(ufs_dir):
        for f in files:
            if f.startswith(TMP_PREFIX):
                continue
            p = os.path.join(root, f)
            try:
                out[os.path.relpath(p, ufs_dir)] = os.stat(p).st_size
            except FileNotFoundError:
                pass
    return out


def ufs_real(files: dict[str, bytes]) -> dict[str, bytes]:
    """ufs_files() without the persister's hidden temp files."""
    return {k: v for k, v in files.items() if not os.path.basename(k).startswith(TMP_PREFIX)}


class Poller:
    """Snapshots of the under-storage directory, taken as fast as possible in a thread."""

    def __init__(self, ufs_dir: Path) -> None:
        self.ufs_dir = ufs_dir
        self.snaps: list[dict[str, int]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.snaps.append(ufs_names(self.ufs_dir))
            time.sleep(0.002)

    def __enter__(self) -> "Poller":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.snaps.append(ufs_names(self.ufs_dir))

    def ever_seen(self) -> set[str]:
        return set().union(*self.snaps) if self.snaps else set()


def one_line_error(p) -> None:
    """A CLI failure as the contract wants it: non-zero, one line on stderr, no traceback."""
    err = p.stderr.strip()
    assert p.returncode != 0, f"expected a failure, got 0: {p.stdout!r} {p.stderr!r}"
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr
    assert err, "no error message on stderr"
    assert len(err.splitlines()) == 1, f"error is not one line:\n{err}"
