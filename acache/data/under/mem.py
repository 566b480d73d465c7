"""mem:// under-storage: an in-memory store for tests, with fault injection.

No global state: each ``MemStore`` holds a ``MemState``; ``open_store("mem://x")``
twice gives two independent stores.  To simulate a restart, share the state:
``store.reopen()`` (or ``MemStore(url, state=old.state)``) is a new instance
over the same files, directories and staged-but-uncommitted uploads.

Semantics follow the file:// store (POSIX-like directories: commit and rename
create parents, rmdir of a non-empty directory fails).  Staged bytes sit in
``state.staged`` until commit/abort/cleanup, so tests can check for leaks.

Test knobs (all plain attributes, safe to change at any time):

    delay      seconds slept before every call (a slow store)
    bandwidth  bytes/second for stage (None: unlimited)
    faults     callable(op, path) run before every call; raise to fail it
    fail_next(n, exc, ops=...)   the next n calls (of those ops) raise exc
    calls      list of (op, path) of every call made, failed ones included
    local_stages  what local_stage() answers (default False: stages on stager threads)

``op`` is one of: check list_dir stat read stage commit abort cleanup rename
delete mkdir rmdir symlink set_attrs.

A symbolic link is a file whose data is its target, its path in ``state.links``;
attributes given by the caller sit in ``state.attrs`` (path -> Attrs).
"""
from __future__ import annotations

import threading
import time
import uuid
from typing import Callable, Iterator

from acache.data.under.base import Attrs, UEntry, rename_needed
from acache.data.under.file import CHUNK, NotFoundError, clean_path, name_of
from acache.errors import ConfigError, PermanentError, TransientError


class MemState:
    """Everything a MemStore holds.  Guarded by ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.files: dict[str, tuple[bytes, float]] = {}   # path -> (data, mtime)
        self.dirs: dict[str, float] = {}                  # explicit dirs -> mtime
        self.staged: dict[str, tuple[str, bytes]] = {}    # token -> (path, data)
        self.staged_attrs: dict[str, Attrs] = {}          # token -> attrs given to stage
        self.links: set[str] = set()                      # files that are symbolic links
        self.attrs: dict[str, Attrs] = {}                 # path -> attrs (files, dirs, links)

    def entry(self, path: str, name: str, is_dir: bool) -> UEntry:
        """The UEntry of an existing file, link or directory (call with the lock held)."""
        a = self.attrs.get(path) or Attrs()
        if is_dir:
            return UEntry(name, True, 0, self.dirs.get(path, 0.0), mode=a.mode, uid=a.uid,
                          gid=a.gid, mtime_ns=a.mtime_ns)
        data, mtime = self.files[path]
        link = data.decode("utf-8", "surrogateescape") if path in self.links else None
        return UEntry(name, False, len(data), mtime, mode=a.mode, uid=a.uid, gid=a.gid,
                      mtime_ns=a.mtime_ns, link=link)

    def move_meta(self, src: str, dst: str) -> None:
        """Links and attrs at or under ``src`` move to ``dst`` (call with the lock held)."""
        pre = src + "/"
        for p in [p for p in self.links if p == src or p.startswith(pre)]:
            self.links.discard(p)
            self.links.add(dst + p[len(src):])
        for p in [p for p in self.attrs if p == src or p.startswith(pre)]:
            self.attrs[dst + p[len(src):]] = self.attrs.pop(p)

    def drop_meta(self, path: str) -> None:
        self.links.discard(path)
        self.attrs.pop(path, None)

    # -- queries (call with the lock held) ---------------------------------
    def is_dir(self, path: str) -> bool:
        if not path or path in self.dirs:
            return True
        pre = path + "/"
        return any(p.startswith(pre) for p in self.files) or \
            any(d.startswith(pre) for d in self.dirs)

    def has_children(self, path: str) -> bool:
        pre = path + "/" if path else ""
        return any(p.startswith(pre) for p in self.files) or \
            any(d.startswith(pre) and d != path for d in self.dirs)

    def add_parents(self, path: str, what: str) -> None:
        """Make every ancestor of ``path`` a directory (mkdir -p of its parent)."""
        parts = path.split("/")[:-1]
        now = time.time()
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d in self.files:
                raise PermanentError(f"mem:// {what}: {d!r} is a file, not a directory")
            self.dirs.setdefault(d, now)


def _injected(op: str, path: str) -> TransientError:
    return TransientError(f"mem:// injected fault in {op} {path!r}")


class MemStore:
    atomic_dir_rename = True

    def __init__(self, url: str, *, state: MemState | None = None, delay: float = 0.0,
                 bandwidth: float | None = None,
                 faults: Callable[[str, str], None] | None = None):
        if not url.startswith("mem://"):
            raise ConfigError(f"bad mem:// URL {url!r}: expected mem://name")
        self.url = url
        self._take: Callable[[int], None] | None = None
        self.state = state if state is not None else MemState()
        self.delay = delay
        self.bandwidth = bandwidth
        self.faults = faults
        self.calls: list[tuple[str, str]] = []
        self.local_stages = False      # what local_stage() answers
        self._fail: list[list] = []   # [remaining, exc, ops or None]
        self._flock = threading.Lock()

    # -- test knobs ----------------------------------------------------------
    def fail_next(self, n: int = 1, exc=None, *, ops=None) -> None:
        """Make the next ``n`` calls (of ``ops``, a name or names; default all) raise.

        ``exc``: an exception instance, an exception class (called with a message),
        a callable ``(op, path) -> exception``, or None for TransientError.
        """
        if isinstance(ops, str):
            ops = (ops,)
        with self._flock:
            self._fail.append([n, exc, frozenset(ops) if ops else None])

    def reopen(self) -> "MemStore":
        """A new instance over the same state (what a restart sees)."""
        return MemStore(self.url, state=self.state, bandwidth=self.bandwidth)

    def _enter(self, op: str, path: str) -> None:
        self.calls.append((op, path))
        exc = None
        with self._flock:
            for rule in self._fail:
                if rule[0] > 0 and (rule[2] is None or op in rule[2]):
                    rule[0] -= 1
                    exc = rule[1] if rule[1] is not None else _injected
                    break
            self._fail = [r for r in self._fail if r[0] > 0]
        if self.delay:
            time.sleep(self.delay)
        if self.faults is not None:
            self.faults(op, path)
        if exc is not None:
            if isinstance(exc, BaseException):
                raise exc
            if isinstance(exc, type):
                raise exc(f"mem:// injected fault in {op} {path!r}")
            raise exc(op, path)

    # -- UnderStore ----------------------------------------------------------
    def check(self) -> None:
        self._enter("check", "")

    def list_dir(self, path: str) -> Iterator[UEntry]:
        clean_path(path)
        self._enter("list_dir", path)
        st = self.state
        pre = path + "/" if path else ""
        out: dict[str, UEntry] = {}
        with st.lock:
            if path in st.files:
                return iter(())
            for p in st.files:
                if p.startswith(pre):
                    rest = p[len(pre):]
                    if "/" in rest:
                        name = rest.partition("/")[0]
                        out.setdefault(name, st.entry(pre + name, name, True))
                    else:
                        out[rest] = st.entry(p, rest, False)
            for d, mtime in st.dirs.items():
                if d.startswith(pre) and d != path:
                    name = d[len(pre):].partition("/")[0]
                    out.setdefault(name, st.entry(pre + name, name, True))
        return iter(sorted(out.values(), key=lambda u: u.name))

    def stat(self, path: str) -> UEntry | None:
        clean_path(path)
        self._enter("stat", path)
        st = self.state
        with st.lock:
            if path in st.files:
                return st.entry(path, name_of(path), False)
            if st.is_dir(path):
                return st.entry(path, name_of(path), True)
        return None

    def read(self, path: str, offset: int, length: int) -> bytes:
        clean_path(path)
        self._enter("read", path)
        with self.state.lock:
            ent = self.state.files.get(path) if path not in self.state.links else None
        if ent is None:
            raise NotFoundError(f"mem:// no file {path!r}")
        return ent[0][offset:offset + max(length, 0)]

    def new_token(self, path: str) -> str:
        clean_path(path)
        return f"{uuid.uuid4().hex}\n{path}"

    def local_stage(self, size: int) -> bool:
        return self.local_stages    # a test knob: stage() is a store call all the same

    def stage(self, path: str, token: str, src_path: str, size: int,
              progress: Callable[[int], None] | None = None,
              attrs: Attrs | None = None,
              on_token: Callable[[str], None] | None = None) -> "MemStaged":
        clean_path(path)
        if not path:
            raise PermanentError("cannot stage onto the root directory")
        self._enter("stage", path)
        try:
            with open(src_path, "rb") as f:
                data = f.read(size)
        except OSError as e:
            raise TransientError(f"mem:// stage {path!r}: cannot read {src_path}: {e}") from e
        if len(data) < size:
            raise PermanentError(f"source file ended at {len(data)} bytes, expected {size}")
        if self._take is not None:
            for off in range(0, size, CHUNK):
                self._take(min(CHUNK, size - off))
        if self.bandwidth:
            time.sleep(size / self.bandwidth)
        if progress is not None:
            for off in range(0, size, CHUNK):
                progress(min(CHUNK, size - off))
        with self.state.lock:
            self.state.staged[token] = (path, data)
            if attrs is not None:
                self.state.staged_attrs[token] = attrs
        return MemStaged(self, token, path)

    def cleanup(self, token: str) -> None:
        self._enter("cleanup", token)
        with self.state.lock:
            self.state.staged.pop(token, None)
            self.state.staged_attrs.pop(token, None)

    def rename(self, src: str, dst: str) -> None:
        clean_path(src)
        clean_path(dst)
        self._enter("rename", f"{src} -> {dst}")
        if not rename_needed(src, dst):
            return
        st = self.state
        what = f"rename {src!r} -> {dst!r}"
        with st.lock:
            if src in st.files:
                if dst not in st.files and st.is_dir(dst):
                    raise PermanentError(f"mem:// {what}: {dst!r} is a directory")
                st.add_parents(dst, what)
                st.files[dst] = st.files.pop(src)
                st.drop_meta(dst)
                st.move_meta(src, dst)
                return
            if not st.is_dir(src):
                if dst in st.files or st.is_dir(dst):
                    return  # done before (a retry after a crash)
                raise PermanentError(f"mem:// {what}: neither exists")
            if dst in st.files:
                raise PermanentError(f"mem:// {what}: {dst!r} is a file")
            if st.has_children(dst):
                raise PermanentError(f"mem:// {what}: {dst!r} is not empty")
            st.add_parents(dst, what)
            pre, npre = src + "/", dst + "/"
            for p in [p for p in st.files if p.startswith(pre)]:
                st.files[npre + p[len(pre):]] = st.files.pop(p)
            for d in [d for d in st.dirs if d.startswith(pre)]:
                st.dirs[npre + d[len(pre):]] = st.dirs.pop(d)
            st.dirs[dst] = st.dirs.pop(src, time.time())
            st.move_meta(src, dst)

    def delete(self, path: str) -> None:
        clean_path(path)
        self._enter("delete", path)
        st = self.state
        with st.lock:
            if st.files.pop(path, None) is None and path and st.is_dir(path):
                raise PermanentError(f"mem:// delete {path!r}: it is a directory")
            st.drop_meta(path)

    def mkdir(self, path: str, attrs: Attrs | None = None) -> None:
        clean_path(path)
        self._enter("mkdir", path)
        if not path:
            return
        st = self.state
        with st.lock:
            st.add_parents(path + "/x", f"mkdir {path!r}")
            if attrs is not None:
                st.attrs[path] = attrs

    def symlink(self, path: str, target: str, attrs: Attrs | None = None) -> None:
        clean_path(path)
        self._enter("symlink", path)
        if not path or not target:
            raise PermanentError(f"mem:// symlink {path!r} -> {target!r}: invalid")
        st = self.state
        with st.lock:
            if path not in st.files and st.is_dir(path):
                raise PermanentError(f"mem:// symlink {path!r}: it is a directory")
            st.add_parents(path, f"symlink {path!r}")
            st.files[path] = (target.encode("utf-8", "surrogateescape"), time.time())
            st.links.add(path)
            st.attrs.pop(path, None)
            if attrs is not None:
                st.attrs[path] = attrs

    def set_attrs(self, path: str, attrs: Attrs) -> None:
        clean_path(path)
        self._enter("set_attrs", path)
        st = self.state
        with st.lock:
            if path and (path in st.files or st.is_dir(path)):
                st.attrs[path] = attrs

    def rmdir(self, path: str) -> None:
        clean_path(path)
        self._enter("rmdir", path)
        if not path:
            raise PermanentError("cannot remove the root directory")
        st = self.state
        with st.lock:
            if path in st.files:
                raise PermanentError(f"mem:// rmdir {path!r}: not a directory")
            if st.has_children(path):
                raise PermanentError(f"mem:// rmdir {path!r}: directory not empty")
            st.dirs.pop(path, None)
            st.drop_meta(path)

    def set_limiter(self, take: Callable[[int], None] | None) -> None:
        self._take = take

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"MemStore({self.url!r})"


class MemStaged:
    def __init__(self, store: MemStore, token: str, path: str):
        self.token = token
        self.path = path
        self._store = store
        self._committed = False

    def commit(self) -> None:
        s = self._store
        s._enter("commit", self.path)
        st = s.state
        with st.lock:
            if self.token not in st.staged:
                if self._committed:
                    return
                raise TransientError(
                    f"mem:// commit {self.path!r}: the staged data is gone; stage again")
            path, data = st.staged[self.token]
            if path not in st.files and st.is_dir(path):
                raise PermanentError(f"mem:// commit {path!r}: it is a directory")
            st.add_parents(path, f"commit {path!r}")
            st.files[path] = (data, time.time())
            st.drop_meta(path)
            attrs = st.staged_attrs.pop(self.token, None)
            if attrs is not None:
                st.attrs[path] = attrs
            del st.staged[self.token]
            self._committed = True

    def abort(self) -> None:
        s = self._store
        s._enter("abort", self.path)
        with s.state.lock:
            s.state.staged.pop(self.token, None)
            s.state.staged_attrs.pop(self.token, None)
