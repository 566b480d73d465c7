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
half-done stage left behind (temp files, open multipart uploads).
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
class UEntry:
    name: str          # last path component
    is_dir: bool
    size: int = 0
    mtime: float = 0.0  # seconds since the epoch


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
              progress: Callable[[int], None] | None = None) -> Staged:
        """Upload ``size`` bytes of the local file ``src_path``, not yet visible."""

    def cleanup(self, token: str) -> None:
        """Remove whatever a stage with this token left behind (idempotent)."""

    def rename(self, src: str, dst: str) -> None:
        """Move a file or a whole directory tree, replacing a file at dst."""

    def delete(self, path: str) -> None:
        """Delete a file (missing is fine)."""

    def mkdir(self, path: str) -> None:
        """Make a directory and its parents (S3: nothing, or a marker)."""

    def rmdir(self, path: str) -> None:
        """Remove an empty directory (missing is fine)."""

    def close(self) -> None: ...
