"""`acache status --watch`: the node, its persist queue and recent throughput, every second.

On a terminal a rich Live view redraws in place; anywhere else (a pipe, a log, CI) one
plain line per interval, with no control codes.  Ctrl-C (SIGINT) ends it with exit 0:
it is the way a watch ends, not a failure.  A node that goes away ends it with the usual
one-line error and exit 1.
"""
from __future__ import annotations

import sys
import time
from collections import deque
from pathlib import Path
from typing import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from acache.config import human_size as _human
from acache.node.client import Client

HISTORY = 60          # samples kept for the throughput line




_BARS = " ▁▂▃▄▅▆▇█"


def _spark(values: list[float]) -> str:
    top = max(values, default=0) or 1
    return "".join(_BARS[min(len(_BARS) - 1, round(v / top * (len(_BARS) - 1)))] for v in values)


class Rates:
    """Upload and persist throughput between consecutive samples of the node's counters."""

    def __init__(self) -> None:
        self.prev: dict | None = None
        self.upload: deque[float] = deque(maxlen=HISTORY)
        self.persist: deque[float] = deque(maxlen=HISTORY)

    def add(self, st: dict) -> None:
        if self.prev is not None:
            dt = max(1e-3, st["time"] - self.prev["time"])
            self.upload.append(max(0, st["uploaded_bytes"] - self.prev["uploaded_bytes"]) / dt)
            self.persist.append(max(0, st["persisted_bytes"] - self.prev["persisted_bytes"]) / dt)
        self.prev = st

    def now(self) -> tuple[float, float]:
        return (self.upload[-1] if self.upload else 0.0, self.persist[-1] if self.persist else 0.0)


def line(st: dict, rates: Rates) -> str:
    up, pers = rates.now()
    return (f"{time.strftime('%H:%M:%S')} dirty {_human(st['dirty_bytes'])} in {st['dirty_files']} files"
            f" | queue {st['queue']} entries {_human(st['queue_bytes'])}, oldest {st['oldest_age']:.0f}s"
            f" | persisting {st['persisting_files']} files {_human(st['persisting_bytes'])}"
            f" | upload {_human(up)}/s, persisted {_human(pers)}/s (limit {st['upload_limit']})"
            f" | cache {_human(st['cache_used'])} of {_human(st['cache_limit'])}"
            f" | errors {st['last_error'] or '-'}")


def view(st: dict, rates: Rates, node_table: Callable[[dict], Table]):
    q = Table(title="persist queue", show_header=True)
    for col in ("entries", "bytes", "oldest", "persisting", "failed"):
        q.add_column(col, justify="right")
    q.add_row(str(st["queue"]), _human(st["queue_bytes"]), f"{st['oldest_age']:.0f} s",
              f"{st['persisting_files']} files, {_human(st['persisting_bytes'])}", str(st["failed"]))
    up, pers = rates.now()
    t = Table(title=f"throughput (last {len(rates.upload)} s)", show_header=False)
    t.add_row("upload", f"{_human(up):>10}/s", _spark(list(rates.upload)))
    t.add_row("persisted", f"{_human(pers):>10}/s", _spark(list(rates.persist)))
    t.add_row("limit", st["upload_limit"], "")
    return Group(node_table(st), q, t)


def watch_status(socket_path: Path, interval: float, console: Console,
                 node_table: Callable[[dict], Table]) -> None:
    rates = Rates()

    def sample() -> dict:
        with Client(socket_path) as c:
            st = c.call("status")
        rates.add(st)
        return st

    try:
        st = sample()
        if not console.is_terminal:
            while True:
                print(line(st, rates), flush=True)
                time.sleep(interval)
                st = sample()
        with Live(view(st, rates, node_table), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                st = sample()
                live.update(view(st, rates, node_table), refresh=True)
    except KeyboardInterrupt:
        sys.stdout.flush()
        return
