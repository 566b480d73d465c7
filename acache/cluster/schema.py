"""The namespace's wire schema: one dataclass per operation, one table of them.

A node asks the cluster's head for whole namespace operations (``Member.ns``).  Each operation
is a frozen dataclass here; its fields are the request's arguments, with their types.  The one
table, ``OPS``, maps an operation's name to its class, and everything else derives from it:

  * the asking side builds the request (``request(op, **args)``: a wrong or missing argument
    is a bug there, a TypeError before anything is sent) and sends ``encode(req)``;
  * the head decodes what arrived (``decode(op, args)``): an op it does not serve is ENOSYS
    for that request (a node of a newer acache asking an older head), a missing argument, an
    unknown one or one of the wrong type is EINVAL -- never a KeyError in a handler, which
    the peer would see as a bare EIO;
  * the head's handshake lists the ops it serves (``served()``), so a node can tell before it
    asks.

Replies stay msgpack maps; ``REPLIES`` names what each op answers (the shapes are documented
with the head's handlers, acache.cluster.member._Head).
"""
from __future__ import annotations

import dataclasses
import errno
import types
import typing
from dataclasses import dataclass, field

from acache.errors import FsError

# ctx: who asks (acache.fs.types.Ctx as a map: uid, gid, pid, umask), for the ops that create
CTX_KEYS = frozenset({"uid", "gid", "pid", "umask"})


@dataclass(frozen=True)
class Request:
    op: typing.ClassVar[str] = ""
    # mutates the namespace: a copy sent again after a lost reply must be answered, not rerun
    mutates: typing.ClassVar[bool] = True


def _op(name: str, *, mutates: bool = True):
    def wrap(cls):
        cls.op, cls.mutates = name, mutates
        return cls
    return wrap


# -- names --------------------------------------------------------------------------------------
@_op("lookup", mutates=False)
@dataclass(frozen=True)
class Lookup(Request):
    parent: int
    name: bytes


@_op("getattr", mutates=False)
@dataclass(frozen=True)
class GetAttr(Request):
    ino: int


@_op("setattr")
@dataclass(frozen=True)
class SetAttr(Request):
    ino: int
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None
    ctx: dict = field(default_factory=dict)


@_op("mkdir")
@dataclass(frozen=True)
class Mkdir(Request):
    parent: int
    name: bytes
    mode: int
    ctx: dict = field(default_factory=dict)


@_op("symlink")
@dataclass(frozen=True)
class Symlink(Request):
    parent: int
    name: bytes
    target: bytes
    ctx: dict = field(default_factory=dict)


@_op("mknod")
@dataclass(frozen=True)
class Mknod(Request):
    parent: int
    name: bytes
    mode: int
    rdev: int
    ctx: dict = field(default_factory=dict)


@_op("readlink", mutates=False)
@dataclass(frozen=True)
class Readlink(Request):
    ino: int


@_op("unlink")
@dataclass(frozen=True)
class Unlink(Request):
    parent: int
    name: bytes


@_op("rmdir")
@dataclass(frozen=True)
class Rmdir(Request):
    parent: int
    name: bytes


@_op("rename")
@dataclass(frozen=True)
class Rename(Request):
    parent_old: int
    name_old: bytes
    parent_new: int
    name_new: bytes
    flags: int = 0


@_op("readdir", mutates=False)
@dataclass(frozen=True)
class Readdir(Request):
    """One page of entries from ``offset``; the reply says whether there is ``more``."""
    ino: int
    offset: int = 0


@_op("sync", mutates=False)
@dataclass(frozen=True)
class Sync(Request):
    pass


@_op("getxattr", mutates=False)
@dataclass(frozen=True)
class GetXattr(Request):
    ino: int
    name: bytes


@_op("setxattr")
@dataclass(frozen=True)
class SetXattr(Request):
    ino: int
    name: bytes


@_op("removexattr")
@dataclass(frozen=True)
class RemoveXattr(Request):
    ino: int
    name: bytes


# -- files: write and read sessions --------------------------------------------------------------
@_op("create")
@dataclass(frozen=True)
class Create(Request):
    """A new file opened for writing by the asking node (``place``: a cacheless client asks
    the head to place it on a cache worker)."""
    parent: int
    name: bytes
    mode: int
    flags: int
    ctx: dict = field(default_factory=dict)
    place: bool = False
    copy_max: int | None = None


@_op("open_write")
@dataclass(frozen=True)
class OpenWrite(Request):
    """``copy_max``: the largest file the asking holder copies into a new generation; a
    bigger one it would rather write in place, its pending PUT held for its close
    (journal.hold_put), as one host does without reflinks.  None: any size (reflinks)."""
    ino: int
    trunc: bool
    place: bool = False
    copy_max: int | None = None


@_op("source", mutates=False)
@dataclass(frozen=True)
class Source(Request):
    ino: int


@_op("open_read")
@dataclass(frozen=True)
class OpenRead(Request):
    ino: int


@_op("copied")
@dataclass(frozen=True)
class Copied(Request):
    ino: int
    gen: int


@_op("close")
@dataclass(frozen=True)
class Close(Request):
    """The last close of a write session: journal the file with this size and these times.
    ``began``: the token of the Began notice the node sent when this close began ("": none).
    ``again``: the kernel wrote the cache file itself after the session's last close and its
    (size, mtime) cannot tell whether that changed it (stores through a mapping into pages
    already dirty): journal it again unless the PUT that close journaled has not started."""
    ino: int
    gen: int
    size: int
    mtime_ns: int
    ctime_ns: int
    began: str = ""
    again: bool = False


@_op("began", mutates=False)
@dataclass(frozen=True)
class Began(Request):
    """Closes began on the asking node (its engine read their FLUSH), sent ahead of the
    closes themselves: the head orders each of those closes by when this arrived (CallEdge)."""
    tokens: list


@_op("reopen")
@dataclass(frozen=True)
class Reopen(Request):
    ino: int
    gen: int


@_op("end_write")
@dataclass(frozen=True)
class EndWrite(Request):
    """The node released its last write handle of the file.  ``again``: as Close's, checked
    in the batch that ends the session (the common case of a session the kernel wrote
    directly: no call of its own)."""
    ino: int
    gen: int
    again: bool = False


@_op("end_read")
@dataclass(frozen=True)
class EndRead(Request):
    ino: int
    gen: int


@_op("fsync")
@dataclass(frozen=True)
class Fsync(Request):
    """A durable record of a file open for writing: its size and mtime now."""
    ino: int
    gen: int
    size: int
    mtime_ns: int


@_op("evict")
@dataclass(frozen=True)
class Evict(Request):
    ino: int
    gen: int


@_op("rejoin")
@dataclass(frozen=True)
class Rejoin(Request):
    """A (re)started node's cache files: ``[[ino, gen, size], ...]``."""
    files: list = field(default_factory=list)


# -- persisting ------------------------------------------------------------------------------------
@_op("flush", mutates=False)
@dataclass(frozen=True)
class Flush(Request):
    """The durability barrier over ``path`` ("" the whole mount), waiting up to ``timeout``."""
    path: str = ""
    timeout: float | None = None


@_op("hurry", mutates=False)
@dataclass(frozen=True)
class Hurry(Request):
    """The asking node's cache is full of dirty data and its writers wait for room: persist
    what is journaled now, without the flush delay (the one-host CacheDir.on_stall)."""


@_op("journal", mutates=False)
@dataclass(frozen=True)
class Journal(Request):
    limit: int = 100


@_op("journal_skip")
@dataclass(frozen=True)
class JournalSkip(Request):
    seq: int
    reason: str


@_op("status", mutates=False)
@dataclass(frozen=True)
class Status(Request):
    path: str | None = None


OPS: dict[str, type[Request]] = {c.op: c for c in (
    Lookup, GetAttr, SetAttr, Mkdir, Symlink, Mknod, Readlink, Unlink, Rmdir, Rename, Readdir,
    Sync, GetXattr, SetXattr, RemoveXattr, Create, OpenWrite, Source, OpenRead, Copied, Close,
    Began, Reopen, EndWrite, EndRead, Fsync, Evict, Rejoin, Flush, Hurry, Journal, JournalSkip, Status)}

# what each op answers (a msgpack map): "attr" is acache.fs.types.Attr as a map, {} nothing
REPLIES: dict[str, str] = {
    "lookup": "attr", "getattr": "attr", "setattr": "attr", "mkdir": "attr", "symlink": "attr",
    "mknod": "attr", "readlink": "{target}", "unlink": "{}", "rmdir": "{}", "rename": "{}",
    "readdir": "{entries: [[name, attr]], next, more}", "sync": "{}", "getxattr": "{value}",
    "setxattr": "{}", "removexattr": "{}",
    "create": "{ino, gen, same, src, holder, attr, ...}", "open_write": "{gen, same, src, holder, ...}",
    "source": "{gen, holder, cached, ...}", "open_read": "{gen, holder, cached, ...}",
    "copied": "{}", "close": "{}", "began": "{}", "reopen": "{}", "end_write": "{}", "end_read": "{}",
    "fsync": "{}", "evict": "{ok}", "rejoin": "{clean, drop, ...}", "flush": "{ok, error?, ...}",
    "hurry": "{}", "journal": "{total, entries}", "journal_skip": "{...}", "status": "{head, queue, ...}"}
assert set(REPLIES) == set(OPS)


def served() -> list[str]:
    """The ops a head of this acache serves (for the handshake)."""
    return sorted(OPS)


def request(op: str, **args) -> Request:
    """The request for ``op`` (the asking side; TypeError on a wrong argument: a bug)."""
    cls = OPS.get(op)
    if cls is None:
        raise TypeError(f"no namespace op {op!r}")
    req = cls(**args)
    problem = _check(req)
    if problem:
        raise TypeError(f"namespace op {op}: {problem}")
    return req


def encode(req: Request) -> tuple[str, dict]:
    return req.op, {f.name: getattr(req, f.name) for f in dataclasses.fields(req)}


def decode(op: object, args: object) -> Request:
    """What a peer sent, checked: ENOSYS for an op not served here, EINVAL for bad arguments."""
    cls = OPS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise FsError(errno.ENOSYS, f"namespace op {op!r} is not served by this acache")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise FsError(errno.EINVAL, f"namespace op {op}: arguments are not a map")
    names = {f.name for f in dataclasses.fields(cls)}
    extra = [k for k in args if k not in names]
    if extra:
        raise FsError(errno.EINVAL, f"namespace op {op}: unknown argument {extra[0]!r}")
    try:
        req = cls(**args)
    except TypeError:
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in args
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        raise FsError(errno.EINVAL, f"namespace op {op}: missing argument "
                                    f"{missing[0] if missing else '?'!r}") from None
    problem = _check(req)
    if problem:
        raise FsError(errno.EINVAL, f"namespace op {op}: {problem}")
    return req


_HINTS: dict[type, dict[str, object]] = {}


def _hints(cls: type) -> dict[str, object]:
    h = _HINTS.get(cls)
    if h is None:
        h = _HINTS[cls] = typing.get_type_hints(cls)
    return h


def _ok(value: object, tp: object) -> bool:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return any(_ok(value, t) for t in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is bool:
        return isinstance(value, bool)
    if tp is bytes:
        return isinstance(value, bytes)
    if tp is str:
        return isinstance(value, str)
    if tp is list:
        return isinstance(value, (list, tuple))
    if tp is dict:
        return isinstance(value, dict)
    return False


def _check(req: Request) -> str:
    """What is wrong with ``req``'s fields ('' nothing)."""
    hints = _hints(type(req))
    for f in dataclasses.fields(req):
        v = getattr(req, f.name)
        if not _ok(v, hints[f.name]):
            return f"argument {f.name!r} is {type(v).__name__}, not {hints[f.name]}"
    ctx = getattr(req, "ctx", None)
    if ctx:
        bad = [k for k, v in ctx.items() if k not in CTX_KEYS or not _ok(v, int)]
        if bad:
            return f"ctx key {bad[0]!r} is unknown or not an int"
    tokens = getattr(req, "tokens", None)
    if tokens is not None and not all(isinstance(t, str) and 0 < len(t) <= 64 for t in tokens):
        return "tokens is not a list of short strings"
    rej = getattr(req, "files", None)
    if rej is not None:
        for item in rej:
            if not (isinstance(item, (list, tuple)) and len(item) == 3
                    and all(_ok(x, int) for x in item)):
                return "files is not a list of [ino, gen, size]"
    return ""
