"""The persister: applies the journal to the under-storage, in order.

PUT entries are *staged* (uploaded, not visible) in parallel, up to
``concurrency`` at a time and ahead of the head of the journal; every entry is
*committed* in seq order (the commit point of DESIGN.md point 4), except that PUTs
whose closes overlapped in time may commit in parallel (Entry.after: order =
happens-before, so a checkpoint's ranks closing their shards at once do not queue).
Errors: transient ones are retried forever with exponential backoff and jitter;
permanent ones are recorded (``status``, ``flush --wait``) and retried slowly,
and at once when someone asks for a flush.  Nothing is ever dropped.

Threads: one scheduler thread (commits, applies renames/deletes) and a pool of
stager threads; a stage that only reads the cache file (UnderStore.local_stage: an S3
small file, hashed now and sent by its commit) runs on the scheduler thread between
commits, as a thread hop would cost more than it.  All bookkeeping is under the
MetaStore lock.
"""
from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol

from acache.data.cache import CacheDir
from acache.data.under.base import Attrs, Staged, UnderStore
from acache.errors import AcacheError, ConfigError, UnderStoreError
from acache.meta.store import Entry, MetaStore

log = logging.getLogger("acache.persister")
RATE_WINDOW = 10.0         # s of history rate() keeps
WINDOW = 256             # how far past the head staging may run
# (GroupCommit) how long the record of an applied entry may wait for another write to share
# its KV write: nobody waits for it; a restart within that time applies the entry again
RECORD_LINGER = 0.05


class Files(Protocol):
    """What the persister asks of the layer that owns the cache files it uploads (one host's
    VFS, the cluster head's namespace), handed once with :meth:`Persister.attach`."""

    def gc_gen(self, ino: int, gen: int) -> None:
        """An applied or dropped entry no longer needs generation ``gen``'s cache file."""

    def withdraw_put(self, e: Entry) -> bool:
        """Asked under the lock before staged PUT ``e`` commits: True when it was withdrawn
        (its file was written after the close that journaled it)."""


class Holders(Protocol):
    """A cluster head's: a PUT's bytes are on the node that holds them (Entry.node), not
    necessarily in this cache (acache.cluster.member._Head)."""

    def pull(self, e: Entry) -> None:
        """Copy ``e``'s bytes from their holder into this cache (a stage thread; raises
        UnderStoreError to retry); its cache file is not checked before that."""

    def stage_elsewhere(self, e: Entry, progress: Callable[[int], None],
                        on_token: Callable[[str], None]) -> Staged | None:
        """Stage ``e`` with no copy here (S3 multipart: the holder sends the parts); None
        where that cannot be (then: pull)."""


class _NoFiles:
    def gc_gen(self, ino: int, gen: int) -> None:
        return None

    def withdraw_put(self, e: Entry) -> bool:
        return False


class _Aborted(Exception):
    pass


def _below_any(path: str, dirs: set[str]) -> bool:
    """Is ``path`` strictly below one of ``dirs``?"""
    i = path.find("/")
    while i >= 0:
        if path[:i] in dirs:
            return True
        i = path.find("/", i + 1)
    return False


@dataclass
class Job:
    entry: Entry
    state: str = "staging"          # staging | staged | committing | failed
    staged: Staged | None = None
    error: BaseException | None = None
    aborted: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    sent: int = 0
    ticket: int = 0                 # the batch that recorded its stage (MetaStore.wait_ticket)


class Persister:
    def __init__(self, meta: MetaStore, cache: CacheDir, under: UnderStore, *,
                 flush_delay: float = 1.0, concurrency: int = 4,
                 holders: Holders | None = None) -> None:
        self.meta, self.cache, self.under = meta, cache, under
        self.flush_delay = flush_delay
        self.clock = meta.clock        # the clock of Entry.t (flush delay) and of retries
        self.lock = meta.lock
        self.cond = threading.Condition(self.lock)
        self.jobs: dict[int, Job] = {}
        # the jobs whose stage is running (seq -> job) and how many of them each cache file
        # (ino, gen) has: uses() and the count of running stages without a scan of the jobs
        # (uses() is asked at every unlink and cache gc).  Kept exact by _add_job, _pop_job
        # and _stage_ended, the only places a job joins, leaves or stops staging.
        self._staging: dict[int, Job] = {}
        self._staging_of: dict[tuple[int, int], int] = {}
        # stages started by _schedule that only read the cache file (UnderStore.local_stage:
        # an S3 small file): run by the loop itself, outside the lock, before its commits
        self._inline: list[Job] = []
        self._aborting: dict[int, Job] = {}    # cancelled jobs whose stage is not thrown away yet
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="acache-stage")
        self.concurrency = concurrency
        self.urgent_seq = 0
        # entries being applied right now (a rename/delete/mkdir/rmdir alone; PUTs whose
        # closes overlapped in time several at once: _pick)
        self._committing: dict[int, Entry] = {}
        self.commit_pool = ThreadPoolExecutor(concurrency, thread_name_prefix="acache-commit")
        self._outage = False                    # the last attempt failed: probe, one at a time
        self.files: Files = _NoFiles()          # attach(): the owner of the cache files
        self.holders = holders                  # a cluster's head: bytes on other nodes
        self._retry_at: dict[int, float] = {}   # seq -> self.clock() of the next try
        self._attempts: dict[int, int] = {}
        self.failed: dict[int, str] = {}        # seq -> permanent error message
        self.last_error = ""
        self.bytes_done = 0
        self.files_done = 0
        self.errors = {"transient": 0, "permanent": 0}   # failed attempts by kind (metrics)
        self._rate: deque = deque(maxlen=4096)  # (time, bytes_done) after each commit
        self._stop = False
        self._sleep_until: float | None = None  # the loop waits for work until then
        self._thread = threading.Thread(target=self._run, name="acache-persister", daemon=True)

    # -- Inflight, for the journal rules (called under the lock) -------------------
    def state(self, seq: int) -> str:
        if seq in self._committing:   # a rename/delete/mkdir/rmdir as much as a put
            return "committing"
        job = self.jobs.get(seq)
        if job is None:
            return ""
        return "committing" if job.state == "committing" else "staging"

    def abort(self, seq: int) -> None:
        job = self._pop_job(seq)
        if job is not None:
            job.aborted = True
            self._aborting[seq] = job
            if job.done.is_set():   # its stage already finished: nobody else throws it away
                try:
                    self.pool.submit(self._discard, job)
                except RuntimeError:   # shutting down: the token is cleaned at restart
                    self._aborting.pop(seq, None)
        self._retry_at.pop(seq, None)
        self.failed.pop(seq, None)
        self.cond.notify_all()

    def uses(self, ino: int, gen: int) -> bool:
        """Is a stage of cache file (ino, gen) running (it reads the file)?"""
        return (ino, gen) in self._staging_of

    # -- the jobs and their index (under the lock) -------------------------------------
    def _add_job(self, job: Job) -> None:
        e = job.entry
        self.jobs[e.seq] = job
        self._staging[e.seq] = job
        key = (e.ino, e.gen)
        self._staging_of[key] = self._staging_of.get(key, 0) + 1

    def _pop_job(self, seq: int) -> Job | None:
        job = self.jobs.pop(seq, None)
        if job is not None:
            self._stage_ended(job)
        return job

    def _stage_ended(self, job: Job) -> None:
        e = job.entry
        if self._staging.get(e.seq) is not job:
            return
        del self._staging[e.seq]
        key = (e.ino, e.gen)
        n = self._staging_of[key] - 1
        if n:
            self._staging_of[key] = n
        else:
            del self._staging_of[key]

    # -- control ---------------------------------------------------------------------
    def attach(self, files: Files) -> None:
        """The layer that owns the cache files (built after the persister: it needs it)."""
        if not isinstance(self.files, _NoFiles):
            raise RuntimeError("the persister's cache files have an owner already")
        self.files = files

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self.lock:
            self._stop = True
            for job in self.jobs.values():
                job.aborted = True
            self.cond.notify_all()
        self._thread.join(timeout=30)
        self.commit_pool.shutdown(wait=True, cancel_futures=True)
        self.pool.shutdown(wait=True, cancel_futures=True)

    def wake(self) -> None:
        """Something was journaled or cancelled.  A new entry is due ``flush_delay`` from
        now: if the loop sleeps less than that anyway, waking it would only rescan the
        journal's head under the lock, once per namespace operation (a cancelled stage
        lets the next entry go at most ``flush_delay`` later)."""
        with self.lock:
            if self._sleep_until is not None \
                    and self._sleep_until <= time.monotonic() + self.flush_delay:
                return
            self.cond.notify_all()

    def hurry(self, seq: int) -> None:
        """Skip the flush delay (and any backoff) for entries up to ``seq``."""
        with self.lock:
            self.urgent_seq = max(self.urgent_seq, seq)
            for s in list(self._retry_at):
                if s <= seq:
                    self._retry_at[s] = 0.0
            self.cond.notify_all()

    def rate(self, window: float = RATE_WINDOW) -> float:
        """Bytes per second persisted over the last ``window`` seconds (at most RATE_WINDOW:
        older samples are pruned as commits are counted)."""
        now = time.monotonic()
        before = 0
        for t, b in self._rate:        # the total as it stood when the window opened
            if t >= now - window:
                break
            before = b
        return (self.bytes_done - before) / window

    def in_flight(self) -> list[Job]:
        with self.lock:
            return list(self.jobs.values())

    def queue_stats(self) -> dict:
        """The persist queue now (metrics, status --watch): cheap, one pass over the jobs;
        the journal's length and bytes are kept by the MetaStore."""
        with self.lock:
            jobs = [j for j in self.jobs.values() if j.entry.op == "put"]
            head = self.meta.head(1)
            return {"persisting_files": len(jobs),
                    "persisting_bytes": sum(j.entry.size for j in jobs),
                    "persisting_sent_bytes": sum(j.sent for j in jobs),
                    "oldest_age": max(0.0, self.clock() - head[0].t) if head else 0.0,
                    "persisted_bytes": self.bytes_done, "persisted_files": self.files_done,
                    "errors": dict(self.errors), "failed": len(self.failed),
                    "retrying": len(self._retry_at)}

    # -- the loop ----------------------------------------------------------------------
    def _eligible_at(self, e: Entry) -> float:
        at = self._retry_at.get(e.seq, 0.0)
        if e.seq > self.urgent_seq:
            at = max(at, e.t + self.flush_delay)
        return at

    def _run(self) -> None:
        while True:
            with self.lock:
                if self._stop:
                    return
                timeout: float | None = None
                try:
                    timeout = self._schedule()
                except AcacheError as exc:  # a metadata write failed (logged, undone): soon again
                    self.last_error = f"scheduling uploads: {exc}"
                except Exception as exc:   # a bug: never let the one persister thread die
                    log.exception("scheduling uploads failed (retrying in 1 s)")
                    self.last_error = \
                        f"internal error scheduling uploads: {type(exc).__name__}: {exc}"
                inline, self._inline = self._inline, []    # (started before a failure too)
                picks: list[tuple[Entry, Job | None]] = []
                alongside = False
                if timeout is None:
                    if not inline:
                        self.cond.wait(1.0)
                        continue
                else:
                    picks, alongside = self._pick()
                    if not picks and not inline:
                        self._sleep_until = time.monotonic() + timeout
                        try:
                            self.cond.wait(timeout)
                        finally:
                            self._sleep_until = None
                        continue
                for e, job in picks:
                    if job is not None:
                        job.state = "committing"
                    elif e.op in ("mkdir", "symlink", "attrs"):
                        e.attrs = self._attrs_of(e.ino)   # as they are now (journal.on_attrs)
                    self._committing[e.seq] = e   # from now on the journal rules may not cancel it
            for job in inline:               # reads of cache files (local_stage), unlocked
                self._stage(job)
            if not picks:
                continue
            if len(picks) == 1 and not alongside:
                self._commit(*picks[0])     # nothing may commit alongside it: no thread hop
                continue
            for e, job in picks:
                try:
                    self.commit_pool.submit(self._commit, e, job)
                except RuntimeError:              # shutting down
                    with self.lock:
                        self._committing.pop(e.seq, None)
                        if job is not None:
                            job.state = "staged"

    def wait_moves(self, timeout: float = 30.0) -> bool:
        """Wait until no RENAME is being applied: while one is, its objects may be at the
        new place in the under-storage before the metadata says so (Inode.upath), and a
        reader of the old place finds nothing.  False if one still is after ``timeout``."""
        with self.lock:
            return self.cond.wait_for(lambda: not any(
                e.op == "rename" for e in self._committing.values()), timeout)

    def _commit(self, e: Entry, job: Job | None) -> None:
        try:
            self._apply(e, job)
        except UnderStoreError as err:
            self._failed(e, err)
        except AcacheError as err:  # a metadata write failed (logged, undone): retry
            self._failed(e, UnderStoreError(str(err), retryable=True))
        except Exception as err:   # a bug or an unexpected OS error: keep the entry, retry
            log.exception("persisting seq %d (%s %s) failed", e.seq, e.op, e.path)
            self._failed(e, UnderStoreError(f"{type(err).__name__}: {err}", retryable=True))
        finally:
            with self.lock:
                self._committing.pop(e.seq, None)
                self.cond.notify_all()

    def _pick(self) -> tuple[list[tuple[Entry, Job | None]], bool]:
        """The entries to commit now (under the lock).  The journal's oldest entry when it
        is ready; with it, or while others commit, every later PUT whose own ordering allows
        it: the entries up to its ``after`` have landed (nothing before it that had returned
        when its close began is still pending), no earlier pending entry has its path or
        inode, and no entry other than a PUT comes before it (renames, deletes, directories
        and attributes are applied alone, in seq order, after everything before them).
        Also whether other PUTs may commit alongside these, now or once staged."""
        entries = self.meta.head(WINDOW)
        if not entries:
            return [], False
        first = entries[0]
        if first.op != "put":
            if self._committing or not self._head_ready(first):
                return [], False
            return [(first, None)], False
        room = self.concurrency - len(self._committing)
        alongside = bool(self._committing)
        picks: list[tuple[Entry, Job | None]] = []
        paths: set[str] = set()
        inos: set[int] = set()
        for e in entries:
            if e.op != "put" or room <= 0:
                break
            after = e.after if e.after >= 0 else e.seq - 1
            if after >= first.seq:
                break            # waits for an entry still pending (and, near enough, so do
                                 # those after it: ``after`` grows with seq)
            if e.seq not in self._committing and e.path not in paths and e.ino not in inos \
                    and self._head_ready(e):
                job = self.jobs[e.seq]
                if job.error is None and self.files.withdraw_put(e):
                    break        # the journal changed under the scan: look again
                picks.append((e, job))
                room -= 1
            elif e.seq not in self._committing:
                alongside = True         # could go once staged: keep the loop free for it
            paths.add(e.path)
            inos.add(e.ino)
        return picks, alongside

    def _schedule(self) -> float:
        """Start stages that are due; return how long to sleep at most.  Called after every
        entry applied, so it looks at the PUTs of the journal's head and the path changes
        before them (MetaStore's indexes), never at every entry of the window."""
        head = self.meta.head(WINDOW)
        if not head:
            return 1.0
        last = head[-1].seq              # the window: staging runs at most this far ahead
        staging = len(self._staging)
        if staging >= self.concurrency:
            return 1.0                   # no slot: a stage that ends notifies the loop
        now = self.clock()
        wake = 1.0
        # the flush delay counts from e.t, which grows with seq: past the first PUT not due
        # yet, none is due (unless a retry time or a hurry() says otherwise)
        ordered = not self._retry_at
        changes = self.meta.path_changes()
        change = next(changes, None)
        moved: set[str] = set()   # paths an earlier mkdir/rename/delete/rmdir still has to change
        first_put = True
        for e in self.meta.pending_puts():
            if e.seq > last:
                break
            while change is not None and change.seq < e.seq:
                moved.update(p for p in (change.path, change.dst) if p)
                change = next(changes, None)
            if not first_put and self._outage:
                break            # the under-storage is failing: only the first PUT probes it
            first_put = False
            if e.seq in self.jobs or e.hold:
                continue         # a held PUT waits for its file's next close
            if moved and _below_any(e.path, moved):
                # staging may create the parents of e.path (file://: the temp file lives
                # there): not before the earlier change of one of them has landed (a
                # directory made there early would outlive a cancelled MKDIR)
                continue
            at = self._eligible_at(e)
            if at > now:
                wake = min(wake, at - now)
                if ordered and e.seq > self.urgent_seq:
                    break
                continue
            if staging >= self.concurrency:
                break
            self._start_stage(e)
            staging += 1
        return max(wake, 0.01)

    def _head_ready(self, head: Entry) -> bool:
        if head.op != "put":
            if any(j.entry.path.startswith(p + "/") for j in self._aborting.values()
                   for p in (head.path, head.dst) if p):
                return False    # a cancelled stage still has its temp file in there: moving
                                # or removing the directory now would leave it behind
            return self._eligible_at(head) <= self.clock()
        job = self.jobs.get(head.seq)
        return job is not None and job.done.is_set()

    def _cache_problem(self, e: Entry) -> str:
        """Why the cache file of a PUT cannot be what was acknowledged ('' if it can)."""
        path = self.cache.path(e.ino, e.gen)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            size = -1
        if size >= e.size:
            return ""
        what = "missing" if size < 0 else f"short ({size} of {e.size} bytes)"
        return (f"cache file {what}: {path}; nothing is uploaded from it (restore it, or "
                f"`acache journal skip {e.seq}` to give this entry up)")

    def _start_stage(self, e: Entry) -> None:
        problem = "" if self.holders is not None else self._cache_problem(e)
        if problem:    # never upload less than was acknowledged (an empty file over a good copy)
            if self.failed.get(e.seq) != problem:
                log.error("persisting put %s failed: %s", e.path, problem)
            self.failed[e.seq] = problem
            self.last_error = f"put {e.path}: {problem}"
            self._retry_at[e.seq] = self.clock() + 60.0   # checked again then, and on flush
            return
        self.failed.pop(e.seq, None)     # a new attempt: its last failure is history
        txn = self.meta.txn()
        if e.token:                      # an earlier attempt's leftovers may remain
            txn.orphan_stage(e.token)
        e.token = self.under.new_token(e.path)
        e.attrs = self._attrs_of(e.ino)   # later changes: an ATTRS entry (journal.on_attrs)
        txn.update_entry(e)
        txn.commit(lazy=True)         # (GroupCommit) it may share the next operation's KV write
        job = Job(e, ticket=txn.ticket)
        self._add_job(job)
        if self.holders is None and self.under.local_stage(e.size):
            self._inline.append(job)      # no thread hop for a read of the cache file
        else:
            self.pool.submit(self._stage, job)

    def _stage(self, job: Job) -> None:
        e = job.entry

        def progress(n: int) -> None:
            job.sent += n
            if job.aborted:
                raise _Aborted()

        def on_token(token: str) -> None:
            """The stage knows exactly what it leaves behind (S3: its upload id): recorded
            in the entry before any byte is sent, so only that is ever cleaned up."""
            with self.lock:
                txn = self.meta.txn()
                if self.meta.entry(e.seq) is e and not job.aborted:
                    e.token = token
                    txn.update_entry(e)
                else:        # cancelled meanwhile: its old token is recorded as orphaned
                    txn.orphan_stage(token)
                txn.commit()
            self.meta.wait_ticket(txn.ticket)   # recorded, not just queued (GroupCommit)

        staged, error = None, None
        try:
            # no byte under a stage whose record has not landed (a KV written behind); a
            # patient wait: that record waits a little for a namespace call's KV write
            self.meta.wait_ticket(job.ticket, patient=True)
            if self.holders is not None and e.op == "put":
                staged = self.holders.stage_elsewhere(e, progress, on_token)
                if staged is None:
                    self.holders.pull(e)
                    problem = self._cache_problem(e)
                    if problem:
                        raise UnderStoreError(f"put {e.path}: {problem}", retryable=True)
            if staged is None:
                staged = self.under.stage(e.path, e.token, self.cache.path(e.ino, e.gen),
                                          e.size, progress, attrs=Attrs.unpack(e.attrs),
                                          on_token=on_token)
        except _Aborted:
            pass
        except BaseException as exc:   # handed to the scheduler thread
            error = exc
        with self.lock:
            # decided under the lock: an abort() from now on sees done set and discards
            # the stage itself; one before it is seen here
            job.staged, job.error = staged, error
            job.state = "staged" if job.state == "staging" else job.state
            aborted = job.aborted
            job.done.set()
            self._stage_ended(job)
            if error is None and not aborted:
                self._healthy()
            self.cond.notify_all()
        if aborted:
            self._discard(job)
        elif error is not None:    # retried with backoff from now, not when it reaches the head
            self._failed(e, error if isinstance(error, UnderStoreError) else
                         UnderStoreError(f"staging {e.path}: {type(error).__name__}: {error}",
                                         retryable=True))

    def _healthy(self) -> None:
        """Something reached the under-storage (under the lock): if it was failing, the
        outage is over and every entry waiting for a retry is tried again now."""
        if self._outage:
            self._outage = False
            for s in self._retry_at:
                self._retry_at[s] = 0.0
            log.info("the under-storage works again: retrying %d entries now", len(self._retry_at))

    def _discard(self, job: Job) -> None:
        """Throw away the upload of an aborted job (outside the lock: S3 I/O)."""
        e = job.entry
        if job.staged is not None:
            try:
                job.staged.abort()
            except Exception as exc:
                log.warning("aborting the stage of %s failed: %s", e.path, exc)
        cleaned = self._cleanup(e.token)
        with self.lock:
            if cleaned:   # the cancelled entry's token was recorded (Txn.remove_entry)
                txn = self.meta.txn()
                txn.forget_stage(e.token)
                try:
                    txn.commit()
                except AcacheError:   # the token stays recorded: cleaned again at restart
                    pass
            self._aborting.pop(e.seq, None)
            self.files.gc_gen(e.ino, e.gen)
            self.cond.notify_all()

    def _cleanup(self, token: str) -> bool:
        try:
            self.under.cleanup(token)
            return True
        except Exception as e:  # the token stays recorded: cleaned again at restart
            log.warning("cleanup of %s failed: %s", token, e)
            return False

    def _apply(self, e: Entry, job: Job | None) -> None:
        if e.op == "put":
            assert job is not None, "a PUT is picked with its job (_pick)"
            if job.error is not None:
                err = job.error
                with self.lock:
                    self._pop_job(e.seq)
                if isinstance(err, UnderStoreError):
                    raise err
                raise UnderStoreError(f"staging {e.path}: {err}", retryable=True)
            assert job.staged is not None, "a job that ended without an error has its stage"
            job.staged.commit()
        elif e.op == "rename":
            try:
                self.under.rename(e.path, e.dst)
            except UnderStoreError as err:
                if err.retryable or not self._source_gone(e):
                    raise
                self._rebuild(e, err)
        elif e.op == "delete":
            self.under.delete(e.path)
        elif e.op == "mkdir":
            self.under.mkdir(e.path, Attrs.unpack(e.attrs))
        elif e.op == "symlink":
            self.under.symlink(e.path, e.target, Attrs.unpack(e.attrs))
        elif e.op == "attrs":
            self.under.set_attrs(e.path, Attrs.unpack(e.attrs) or Attrs())
        elif e.op == "rmdir":
            self.under.rmdir(e.path)
        log.debug("applied seq %d: %s %s%s (ino %d gen %d)", e.seq, e.op, e.path,
                  f" -> {e.dst}" if e.dst else "", e.ino, e.gen)
        with self.lock:
            self._done(e)

    # -- a rename whose source another tool removed from the under-storage --------------
    def _source_gone(self, e: Entry) -> bool:
        return self.under.stat(e.path) is None and self.under.stat(e.dst) is None

    def _rebuild(self, e: Entry, err: UnderStoreError) -> None:
        """Apply RENAME ``e`` whose source is gone from the under-storage (removed by another
        tool): what it moves is written at the destination from the cache instead, at the
        rename's place in the order (directories, then files).  Files that will land anyway
        (a later PUT, open for writing) are left to that.  If any file's data is not in
        the cache, nothing is done: the entry fails permanently, for the operator to see
        (`acache journal`) and skip."""
        dirs, files, missing = [], [], []
        with self.lock:
            for ino in e.inos:
                n = self.meta.get(ino)
                if n is None or n.upath is None or not (
                        n.upath == e.path or n.upath.startswith(e.path + "/")):
                    continue
                dst = e.dst + n.upath[len(e.path):]
                if n.is_dir:
                    dirs.append(dst)
                elif self.meta.puts_of(ino) or n.dirty or n.local:
                    continue            # its own PUT (or the next close) lands it
                elif not n.cached or self._cache_problem(
                        Entry(seq=0, op="put", path=dst, ino=ino, gen=n.gen, size=n.size)):
                    missing.append(n.upath)
                else:
                    files.append((dst, ino, n.gen, n.size))
            if missing:
                raise UnderStoreError(
                    f"{err}: it was removed from the under-storage, and {len(missing)} of the "
                    f"files it moves are not in the cache to write them again (e.g. "
                    f"{missing[0]!r}); `acache journal skip {e.seq} --reason ...` gives it up",
                    retryable=False)
            for _, ino, gen, _ in files:    # kept from eviction until written
                self.cache.acquire(ino, gen)
        try:
            for d in sorted(dirs, key=lambda p: p.count("/")):
                self.under.mkdir(d)
            for dst, ino, gen, size in files:
                token = self.under.new_token(dst)
                with self.lock:
                    txn = self.meta.txn()
                    txn.orphan_stage(token)   # cleaned at restart if we die mid-way
                    txn.commit()

                def on_token(new: str, old: str = token) -> None:
                    with self.lock:
                        txn = self.meta.txn()
                        txn.orphan_stage(new)
                        txn.forget_stage(old)
                        txn.commit()
                staged = self.under.stage(dst, token, self.cache.path(ino, gen), size,
                                          on_token=on_token)
                staged.commit()
                with self.lock:
                    txn = self.meta.txn()
                    txn.forget_stage(staged.token)
                    txn.commit()
        finally:
            for _, ino, gen, _ in files:
                self.cache.release(ino, gen)
        log.warning("rename %s -> %s: the source was gone from the under-storage (removed by "
                    "another tool?); wrote %d files and %d directories at %s again from the cache",
                    e.path, e.dst, len(files), len(dirs), e.dst)

    # -- the operator's view of the journal --------------------------------------------
    def entries(self, limit: int = 100) -> tuple[int, list[dict]]:
        """(pending entries, the ``limit`` oldest as dicts) for `acache journal`."""
        with self.lock:
            out = []
            for e in self.meta.head(limit):
                state = self.state(e.seq) or ("held" if e.hold else "pending")
                job = self.jobs.get(e.seq)
                if state == "staging" and job is not None and job.done.is_set() \
                        and job.error is None:
                    state = "staged"     # uploaded, waiting for its turn to commit
                if e.seq in self.failed:
                    state = "failed"
                elif e.seq in self._retry_at and state == "pending":
                    state = "retrying"
                out.append({"seq": e.seq, "op": e.op, "path": e.path, "dst": e.dst,
                            "size": e.size, "state": state, "error": self.failed.get(e.seq, "")})
            return self.meta.journal_len(), out

    def skip(self, seq: int, reason: str) -> dict:
        """The operator gives up entry ``seq`` (it can never succeed): it is dropped from
        the journal, everything after it keeps its order; recorded with the reason.  A
        skipped PUT's file stays in the cache, shown as not persisted."""
        with self.lock:
            e = self.meta.entry(seq)
            if e is None:
                raise ConfigError(f"no pending journal entry {seq} (see `acache journal`)")
            if self.state(seq) == "committing":
                raise ConfigError(f"journal entry {seq} is being applied right now; try again")
            if seq in self.jobs:
                self.abort(seq)
            txn = self.meta.txn()
            txn.remove_entry(seq)
            txn.record_skip(e, reason)
            if e.op == "put":
                node = self.meta.get(e.ino)
                if node is not None and node.gen == e.gen and not node.dirty:
                    node.local = f"not persisted: journal entry {seq} skipped ({reason})"
                    txn.save(node)
                else:
                    txn.freed.append((e.ino, e.gen))
            txn.commit(sync=True)
            for d in (self._retry_at, self.failed, self._attempts):
                d.pop(seq, None)
            if not self.failed and not self._retry_at:
                self.last_error = ""
            log.warning("journal entry %d (%s %s%s) skipped by the operator: %s", seq, e.op, e.path,
                        f" -> {e.dst}" if e.dst else "", reason)
            self.cond.notify_all()
            return {"seq": seq, "op": e.op, "path": e.path, "dst": e.dst}

    def _done(self, e: Entry) -> None:
        """Entry ``e`` is now in the under-storage (called under the lock)."""
        self._healthy()
        self._pop_job(e.seq)
        self._retry_at.pop(e.seq, None)
        self._attempts.pop(e.seq, None)
        self.failed.pop(e.seq, None)
        for s in [s for s in (*self._retry_at, *self.failed) if self.meta.entry(s) is None]:
            self._retry_at.pop(s, None)   # cancelled while waiting for a retry
            self.failed.pop(s, None)
        if not self.failed and not self._retry_at:
            self.last_error = ""          # nothing is failing or waiting for a retry any more
        while True:
            try:
                self._record(e)
                break
            except AcacheError:      # undone (logged): applied, not recorded yet; never apply
                if self._stop:       # it twice while up (a restart applies it again)
                    return
                self.cond.wait(1.0)
        if e.op == "put":
            self.bytes_done += e.size
            self.files_done += 1
            now = time.monotonic()
            r = self._rate
            # samples older than rate()'s window count only as the total when it opened:
            # the last of them is kept, so rate() reads O(1) samples, not the whole deque
            while len(r) >= 2 and r[1][0] < now - RATE_WINDOW:
                r.popleft()
            r.append((now, self.bytes_done))
            self.files.gc_gen(e.ino, e.gen)
        self.cond.notify_all()

    def _record(self, e: Entry) -> None:
        """Take applied entry ``e`` out of the journal; the under-storage has it now."""
        txn = self.meta.txn()
        txn.remove_entry(e.seq)
        if e.token:
            txn.forget_stage(e.token)     # committed: nothing of it is left to clean
        if e.op == "put":
            node = self.meta.get(e.ino)
            if node is not None:
                node.upath = e.path
                txn.save(node)
        elif e.op in ("mkdir", "symlink"):
            node = self.meta.get(e.ino)
            if node is not None:
                node.upath = e.path
                txn.save(node)
        elif e.op == "rename":
            for ino in e.inos:
                n = self.meta.get(ino)
                if n is not None and n.upath is not None and \
                        (n.upath == e.path or n.upath.startswith(e.path + "/")):
                    n.upath = e.dst + n.upath[len(e.path):]
                    txn.save(n)
        # lazy (GroupCommit): nobody waits for it (a barrier looks at the journal in memory),
        # so it may share the next operation's KV write; until it lands, a restart applies
        # the entry again (the cache file is kept until then: on_freed runs after it lands)
        txn.commit(lazy=True, linger=RECORD_LINGER)

    def _attrs_of(self, ino: int) -> list:
        """The attributes an entry of ``ino`` lands with (under the lock)."""
        node = self.meta.get(ino)
        if node is None:
            return []
        return Attrs(node.mode & 0o7777, node.uid, node.gid, node.mtime_ns).pack()

    def _failed(self, e: Entry, err: UnderStoreError) -> None:
        staged = None
        with self.lock:
            if self.meta.entry(e.seq) is None:   # cancelled meanwhile: nothing to retry
                self._pop_job(e.seq)
                return
            self._outage = True
            n = self._attempts.get(e.seq, 0) + 1
            self._attempts[e.seq] = n
            job = self._pop_job(e.seq)
            staged = job.staged if job is not None else None
            self.errors["transient" if err.retryable else "permanent"] += 1
            if err.retryable:
                delay = min(30.0, 0.2 * 2 ** min(n, 10)) * (0.5 + random.random() / 2)
                log.warning("persisting %s %s failed (try %d, again in %.1fs): %s",
                            e.op, e.path, n, delay, err)
                self.last_error = f"{e.op} {e.path}: {err} (retrying)"
            else:
                delay = 15.0
                self.failed[e.seq] = str(err)
                log.error("persisting %s %s failed permanently (data kept, retried every %.0fs "
                          "and on flush): %s", e.op, e.path, delay, err)
                self.last_error = f"{e.op} {e.path}: {err}"
            self._retry_at[e.seq] = self.clock() + delay
            self.cond.notify_all()
        if staged is not None:    # an S3 AbortMultipartUpload: never under the lock
            try:
                staged.abort()
            except Exception as exc:
                log.debug("aborting the failed stage of %s: %s", e.path, exc)
        if e.op == "put" and e.token:
            token = e.token
            if self._cleanup(token):
                with self.lock:
                    txn = self.meta.txn()
                    txn.forget_stage(token)
                    if self.meta.entry(e.seq) is e and e.token == token:
                        e.token = ""      # nothing of that attempt is left
                        txn.update_entry(e)
                    try:
                        txn.commit()
                    except AcacheError:   # undone: cleaned up again later
                        pass
