"""The under-storage seam.

Paths are relative, '/'-separated, never start with '/', never contain '.' or
'..' parts ('' is the root).  Every call is idempotent: the persister retries
any call after a crash or a TransientError, so doing it twice must be harmless
(deleting a missing key succeeds; renaming when src is gone and dst exists
succeeds).  Errors leave as acache.errors.TransientError (retry forever) or
PermanentError (report, keep the data, retry slowly).

Uploads are split in two so that data moves in parallel while only the commit
point is ordered:  ``stage(path, src_path, size)`` uploads the bytes of a
local file without making them visible and returns a Staged; its ``commit()``
makes them visible at ``path`` atomically (POSIX: fsync + rename from a hidden
temp name + fsync of the directory; S3: PutObject or
CompleteMultipartUpload); ``abort()`` throws them away.  ``Staged.token`` is
a short string the persister records durably *before* staging starts
(``new_token``) so that after a crash ``cleanup(token)`` removes what a
half-done stage left behind (temp files, open multipart uploads).  A stage
that learns more of what it leaves behind (S3: the id CreateMultipartUpload
gave) hands a new token to ``on_token`` before it uploads anything, and the
persister records it in place of the old one: cleanup then removes exactly
that stage's leftovers and nothing of anyone else's (another node's live
upload on the same key, in a cluster).

Attributes (``Attrs``: permission bits, owner, mtime in ns) travel with every
object that creates something (stage, symlink, mkdir) and alone with
``set_attrs``; listings and stat give them back in ``UEntry`` (0 / -1 where the
store does not know them: objects written by other tools).  Symbolic links
are data: ``symlink(path, target)`` stores the target, listings show the entry
as a link (``UEntry.link``); no store ever follows one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Protocol


def rename_needed(src: str, dst: str) -> bool:
    """Check a rename's paths the same way in every store: False when there is nothing
    to do (src == dst); PermanentError for the root or a move into itself."""
    from acache.errors import PermanentError
    if not src or not dst:
        raise PermanentError(f"cannot rename the root directory ({src!r} -> {dst!r})")
    if dst.startswith(src + "/"):
        raise PermanentError(f"cannot move {src!r} into itself ({dst!r})")
    return src != dst


@dataclass(frozen=True)
class Attrs:
    """What a store keeps of a file's attributes.  0 / -1 mean "leave as is / unknown"."""
    mode: int = 0          # permission bits (0o7777); 0: unknown
    uid: int = -1
    gid: int = -1
    mtime_ns: int = 0      # 0: unknown

    def pack(self) -> list:
        return [self.mode, self.uid, self.gid, self.mtime_ns]

    @classmethod
    def unpack(cls, raw) -> "Attrs | None":
        return cls(*raw) if raw else None


@dataclass(frozen=True)
class UEntry:
    name: str          # last path component
    is_dir: bool
    size: int = 0
    mtime: float = 0.0  # seconds since the epoch
    mode: int = 0      # permission bits; 0: unknown (written by another tool)
    uid: int = -1      # -1: unknown
    gid: int = -1
    mtime_ns: int = 0  # 0: unknown (use mtime)
    link: str | None = None   # a symbolic link: its target (size = its length in bytes)


NAME_MAX = 255


def bad_name(name: str) -> str | None:
    """Why a listed name cannot be shown in the mount (None: it can)."""
    if name in ("", ".", ".."):
        return "a '.', '..' or empty name"
    if "/" in name or "\0" in name:
        return "a name containing '/' or NUL"
    if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        return f"a name longer than {NAME_MAX} bytes"
    return None


class Staged(Protocol):
    token: str

    def commit(self) -> None: ...

    def abort(self) -> None: ...


class UnderStore(Protocol):
    url: str
    # rename() of a directory is one atomic step (POSIX rename, a locked dict);
    # S3 moves a prefix object by object.  The journal keeps a renamed directory
    # whole where this is true (journal.on_rename).
    atomic_dir_rename: bool

    def check(self) -> None:
        """Raise PermanentError unless the store is reachable and writable."""

    def list_dir(self, path: str) -> Iterator[UEntry]:
        """Children of a directory (one level).  A missing directory lists empty."""

    def stat(self, path: str) -> UEntry | None: ...

    def read(self, path: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``offset`` (short only at end of file)."""

    def new_token(self, path: str) -> str:
        """A fresh token for a stage of ``path``; record it before ``stage``."""

    def stage(self, path: str, token: str, src_path: str, size: int,
              progress: Callable[[int], None] | None = None,
              attrs: Attrs | None = None,
              on_token: Callable[[str], None] | None = None) -> Staged:
        """Upload ``size`` bytes of the local file ``src_path``, not yet visible;
        ``attrs`` land with it at commit.  ``on_token(new)``: record ``new`` in place of
        ``token`` (durably, before returning; raising stops the stage and undoes it);
        the Staged's token is the last one given."""

    def local_stage(self, size: int) -> bool:
        """Would ``stage()`` of ``size`` bytes only read the source (no call to the store,
        nothing written)?  The persister then runs it on its own thread, between commits,
        instead of handing it to a stager thread and waiting to be told it ended."""

    def symlink(self, path: str, target: str, attrs: Attrs | None = None) -> None:
        """Make ``path`` a symbolic link to ``target`` (replacing a file or link there)."""

    def set_attrs(self, path: str, attrs: Attrs) -> None:
        """Change only the attributes of a file, directory or link (never its data).
        A missing path is not an error (deleted behind our back: nothing to change)."""

    def cleanup(self, token: str) -> None:
        """Remove whatever a stage with this token left behind (idempotent)."""

    def rename(self, src: str, dst: str) -> None:
        """Move a file or a whole directory tree, replacing a file at dst."""

    def delete(self, path: str) -> None:
        """Delete a file (missing is fine)."""

    def mkdir(self, path: str, attrs: Attrs | None = None) -> None:
        """Make a directory and its parents (S3: a marker); ``attrs`` apply to ``path``."""

    def rmdir(self, path: str) -> None:
        """Remove an empty directory (missing is fine)."""

    def set_limiter(self, take: Callable[[int], None] | None) -> None:
        """Call ``take(n)`` before sending each piece of ``n`` bytes of an upload (a part,
        a PutObject, a chunk of a copy): the node's bandwidth limit (acache.data.limit),
        shared by every upload.  None: no limit."""

    def close(self) -> None: ...
