"""The upload bandwidth limit: one token bucket shared by every upload of the node.

    upload_limit = "200MiB/s"                      # always
    upload_limit = "08:00,100MiB/s 20:00,off"      # a timetable (local time, like rclone --bwlimit)
    upload_limit = "off"                           # the default: no limit

A timetable is a list of ``HH:MM,RATE`` entries in increasing time order; the entry in
force is the last one whose time of day has passed, and before the first one of the day the
last one of the day before (it wraps around midnight).  A rate is ``SIZE/s`` (``100MiB/s``,
``1.5GiB/s``), a whole number of bytes per second, or ``off``.

The bucket sits in front of each piece an under-store sends (an S3 part or PutObject, a
chunk of a file:// copy): ``take(n)`` reserves ``n`` bytes and sleeps until the bucket has
paid them back.  The bucket holds at most ``burst`` bytes (a quarter of a second at the
rate in force, at least 1 MiB), so over any window of T seconds at most rate * T + burst +
one piece go out.  Only the persister's threads ever wait here: writers never do (they wait
for room in the cache only when dirty data fills it, the usual backpressure).
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

from acache import units

MIN_BURST = 1 << 20


class LimitError(ValueError):
    """A limit that cannot be read; the message says why."""


def _rate(text: str) -> float | None:
    """'100MiB/s' / '1048576' / 'off' -> bytes per second (None: no limit)."""
    t = text.strip()
    if t.lower() in ("off", "unlimited", "none"):
        return None
    num = t[:-2] if t.lower().endswith("/s") else t
    if not re.fullmatch(r"\s*\d+(\.\d+)?\s*[a-zA-Z]*\s*", num):
        raise LimitError(f"{text!r} is not a rate (e.g. 200MiB/s, or off)")
    try:
        v = units.size_rounded(num)
    except units.Bad:
        raise LimitError(f"{text!r} is not a rate (e.g. 200MiB/s, or off)") from None
    if v <= 0:
        raise LimitError(f"{text!r}: a rate must be above 0 (say off for no limit)")
    return float(v)


@dataclass(frozen=True)
class Schedule:
    """[(minute of the day, bytes/s or None)], sorted; one entry with minute -1: constant."""
    entries: tuple[tuple[int, float | None], ...]
    text: str

    def rate_at(self, t: float | None = None) -> float | None:
        if len(self.entries) == 1 and self.entries[0][0] < 0:
            return self.entries[0][1]
        lt = time.localtime(time.time() if t is None else t)
        minute = lt.tm_hour * 60 + lt.tm_min
        rate = self.entries[-1][1]           # before the first entry: the last one, yesterday's
        for at, r in self.entries:
            if at <= minute:
                rate = r
        return rate

    @property
    def off(self) -> bool:
        return all(r is None for _, r in self.entries)


def parse(value: object) -> Schedule:
    """An ``upload_limit`` value -> Schedule (LimitError says what is wrong, in one line)."""
    if isinstance(value, bool):
        raise LimitError("expected a rate (e.g. 200MiB/s), a timetable or off, not a boolean")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise LimitError("a rate must be above 0 (say off for no limit)")
        return Schedule(((-1, float(value)),), f"{int(value)}")
    if not isinstance(value, str) or not value.strip():
        raise LimitError("expected a rate (e.g. 200MiB/s), a timetable (08:00,100MiB/s "
                         "20:00,off) or off")
    words = value.split()
    if len(words) == 1 and "," not in words[0]:
        return Schedule(((-1, _rate(words[0])),), value.strip())
    entries: list[tuple[int, float | None]] = []
    for w in words:
        m = re.fullmatch(r"(\d{1,2}):(\d{2}),(.+)", w)
        if not m:
            raise LimitError(f"timetable entry {w!r}: expected HH:MM,RATE (e.g. 08:00,100MiB/s)")
        hh, mm = int(m.group(1)), int(m.group(2))
        if hh > 23 or mm > 59:
            raise LimitError(f"timetable entry {w!r}: {m.group(1)}:{m.group(2)} is not a time of day")
        at = hh * 60 + mm
        if entries and at <= entries[-1][0]:
            raise LimitError(f"timetable entry {w!r}: times must increase through the day")
        try:
            entries.append((at, _rate(m.group(3))))
        except LimitError as e:
            raise LimitError(f"timetable entry {w!r}: {e}") from None
    return Schedule(tuple(entries), value.strip())


def describe(rate: float | None) -> str:
    if rate is None:
        return "off"
    for unit, n in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if rate >= n:
            return f"{rate / n:.4g} {unit}/s"
    return f"{rate:.0f} B/s"


class TokenBucket:
    """Shared by every upload thread; ``take(n)`` is the one call on the data path."""

    def __init__(self, schedule: Schedule, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.schedule = schedule
        self.clock, self.sleep = clock, sleep
        self._lock = threading.Lock()
        self._tokens = 0.0
        self._last = clock()
        self._rate: float | None = None
        self._checked = -1e18
        self.waited = 0.0             # seconds uploads spent waiting here (metrics)
        self.taken = 0                # bytes that went through (metrics)

    def rate(self) -> float | None:
        """The rate in force (the timetable is looked at most once a second)."""
        now = self.clock()
        if now - self._checked >= 1.0:
            self._checked = now
            self._rate = self.schedule.rate_at()
        return self._rate

    def burst(self, rate: float) -> float:
        return max(MIN_BURST, rate / 4)

    def take(self, n: int) -> None:
        with self._lock:
            self.taken += n
            rate = self.rate()
            now = self.clock()
            if rate is None:
                self._last, self._tokens = now, 0.0
                return
            burst = self.burst(rate)
            self._tokens = min(burst, self._tokens + (now - self._last) * rate)
            self._last = now
            self._tokens -= n           # in debt: this piece waits until it is paid for
            wait = -self._tokens / rate if self._tokens < 0 else 0.0
            if wait > 0:
                self.waited += wait
        if wait > 0:
            self.sleep(wait)
