"""The durability barrier (``acache flush --wait``), one host's or the cluster head's.

``wait`` returns when every journal entry under ``rel`` recorded before it began has reached
the under-storage, and every file under ``rel`` open for writing then has been closed and its
entries have too (DESIGN: the barrier).  It waits on the persister's condition (woken by every
entry applied), looks at the journal at most every FLUSH_SCAN_GAP, and fails with FlushError
on a permanent error of what it waits for (after 1 s) or at ``timeout``.  The daemon calls it
for a mount, the cluster's head for a node's ``flush`` op: ``writers`` is what the VFS has open
for writing (an ino -> session map), ``cache`` the cache directory (its lost+found count).
"""
from __future__ import annotations

import time
from collections.abc import Collection

from acache.errors import FlushError

FLUSH_SCAN_GAP = 0.02     # s: how often a waiting `flush --wait` looks at the journal, at most


def under(path: str, rel: str) -> bool:
    """Is ``path`` ``rel`` or inside it ("" is the whole mount)?"""
    return not rel or path == rel or path.startswith(rel + "/")


def held_for_writer(journal: list, upto: int | None = None) -> dict | None:
    """The oldest PUT in ``journal`` (MetaStore.journal(), which status has at hand) held for
    its writer's close (journal.hold_put: a big file reopened and written in place before its
    upload started), at or before seq ``upto``, and how many entries are journaled after it:
    none of them lands before that close.  None: no such PUT."""
    for i, e in enumerate(journal):
        if upto is not None and e.seq > upto:
            break
        if e.hold:
            return {"path": e.path, "seq": e.seq, "behind": len(journal) - i - 1}
    return None


def _held_before(meta, want: dict) -> str:
    """Why the wait may not end on its own: a held PUT before what it waits for."""
    h = held_for_writer(meta.journal(), max(want)) if want else None
    if h is None:
        return ""
    why = "(reopened and written in place while its upload had not started)"
    if h["seq"] in want:
        return f"; the PUT of {h['path']} waits for its writer to close it {why}"
    return f"; they are behind the PUT of {h['path']}, which waits for its writer to close it {why}"


def wait(meta, persister, cache, writers: Collection[int], rel: str, timeout: float | None,
         progress, t0: float) -> dict:
    p = persister
    with meta.lock:
        target = meta.last_seq()
        waiting_open = {ino for ino in writers
                        if meta.get(ino) is not None and meta.get(ino).nlink > 0
                        and under(meta.path_of(ino), rel)}
        # the entries to wait for, found once: each tick only drops those that landed
        # (O(what this barrier waits for), not O(journal x jobs))
        want = {e.seq: e for e in meta.journal() if e.touches(rel)}
        want_bytes = sum(e.size for e in want.values())   # kept as entries come and go
        failing = [s for s in p.failed if s in want]
    p.hurry(target)
    for s in failing:           # permanent errors are retried at once when asked
        p.hurry(s)
    total_bytes = None
    hurried = t0
    while True:
        scanned = time.monotonic()
        with meta.lock:
            for ino in list(waiting_open):
                if ino not in writers or meta.get(ino) is None:
                    waiting_open.discard(ino)
                    for e in meta.puts_of(ino):
                        if e.touches(rel) and e.seq not in want:
                            want[e.seq] = e
                            want_bytes += e.size
                    p.hurry(meta.last_seq())
            for s in [s for s, e in want.items() if meta.entry(s) is not e]:
                want_bytes -= want.pop(s).size   # applied or cancelled, or carried on by
                n = meta.successor(s)   # another entry (a rename or a new close of what
                if n is not None and n.seq not in want:   # it held): the bytes written
                    want[n.seq] = n                       # before the barrier are in it
                    want_bytes += n.size
                    p.hurry(n.seq)
            # O(failed + running jobs) from here on: this runs under the lock the
            # persister needs, every FLUSH_SCAN_GAP, while it works through ``want``
            failed = [(want[s], msg) for s, msg in sorted(p.failed.items()) if s in want]
            sent = sum(j.sent for s, j in list(p.jobs.items()) if s in want)
            left = want_bytes - sent
            if total_bytes is None:
                total_bytes = left
            info = {"bytes_left": max(0, left), "files_left": len(want),
                    "open_files": len(waiting_open), "total_bytes": total_bytes,
                    "rate": p.rate(), "last_error": p.last_error}
            if not want and not waiting_open:
                return {"ok": True, "seconds": time.monotonic() - t0,
                        "lost_found": cache.lost_found()[0],
                        "unacknowledged": sum(1 for n in meta.inodes() if n.local
                                              and under(meta.path_of(n.ino), rel))}
            if failed and time.monotonic() - t0 > 1.0:
                e, msg = failed[0]
                raise FlushError(f"{e.op} {e.path} failed: {msg} ({len(want)} entries not "
                                 "persisted; the data is kept and retried)")
            if timeout is not None and time.monotonic() - t0 > timeout:
                what = f"{len(want)} journal entries ({max(0, left)} bytes)"
                if waiting_open:
                    what += f" and {len(waiting_open)} files still open for writing"
                raise FlushError(f"timed out after {timeout:g}s: {what} not yet persisted"
                                 + _held_before(meta, want)
                                 + (f"; last error: {p.last_error}" if p.last_error else ""))
            p.cond.wait(0.25)
        # woken by every entry the persister applies: look again at most every
        # FLUSH_SCAN_GAP, waiting outside the lock (a scan is O(what the barrier waits
        # for) under the lock the mount and the persister need)
        gap = time.monotonic() - scanned
        if gap < FLUSH_SCAN_GAP:
            time.sleep(FLUSH_SCAN_GAP - gap)
        if time.monotonic() - hurried > 5.0:   # a waiting barrier: retry at least every 5 s
            hurried = time.monotonic()          # (the backoff grows to 30 s), so the end of
            p.hurry(target)                     # an outage is noticed soon
        if progress is not None:
            progress(info)
