"""Which closes overlapped in time, told by the kernel's request numbers.

DESIGN.md point 4 orders X before Y only if X's close returned before Y's close began.
The daemon sees a request when a thread reads it, which can be long after the caller
began (requests queue in the kernel while the threads are busy, and Python runs one of
them at a time), so "what had been journaled when the FLUSH handler started" (the
default, MetaStore.op) orders many closes that in fact overlapped.  FUSE numbers its
requests (``unique``) in the order the callers made them: if X's reply was not written
yet when Y's request was made, Y's number is at most the highest number read before X
replied.  So each journaling close records, just before its reply, the highest request
number read so far (M) with the journal's last seq; a later close with request number
u must land after every record with M < u, and may land before or with the rest.
"""
from __future__ import annotations

import bisect
import threading

KEEP = 1024         # records kept; older ones count as one (conservatively: all of them)


class Overlap:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.max_read = 0
        self._m: list[int] = []      # M of each record, in record order: nondecreasing
        self._top: list[int] = []    # the highest seq recorded up to and including each
        self._base = 0               # the highest seq of the records dropped

    def seen(self, unique: int) -> None:
        """A request was read (every request, by the reader thread, before it runs)."""
        if unique > self.max_read:
            with self.lock:
                if unique > self.max_read:
                    self.max_read = unique

    def floor(self, unique: int) -> int:
        """The seq up to which everything must land before what request ``unique``
        journals: the entries of every close that replied before it was made."""
        with self.lock:
            i = bisect.bisect_left(self._m, unique)       # records with M < unique
            return self._top[i - 1] if i else self._base

    def replied(self, seq: int) -> None:
        """A close that journaled entries up to ``seq`` is about to reply."""
        with self.lock:
            top = max(seq, self._top[-1] if self._top else self._base)
            self._m.append(self.max_read)
            self._top.append(top)
            if len(self._m) > 2 * KEEP:
                self._base = self._top[-KEEP - 1]
                del self._m[:-KEEP], self._top[:-KEEP]
