"""file:// under-storage: a POSIX directory (local disk, NFS, Lustre).

``file:///abs/dir`` maps store path ``a/b`` to ``/abs/dir/a/b``.

Staging and commit (the durability rule of each step):

    stage   copy the source into ``<dir>/.acache-tmp.<uuid>`` (copy_file_range,
            falling back to sendfile, then pread/pwrite), fsync the temp file.
            The temp file lives in the destination directory, so the commit is
            a same-filesystem rename.  Missing parent directories are created
            (and their parents fsync'd) at stage time: an empty directory may
            show up before the commit, a file never does.
    commit  rename the temp file onto the final name, fsync the directory.
    abort   unlink the temp file.

The token *is* the temp file's store path (``<dir>/.acache-tmp.<uuid>``), so
``cleanup(token)`` finds the leftovers of a crashed stage with nothing else
recorded.  Names starting with ``.acache-tmp.`` are reserved: listings and
stat hide them.

OSErrors leave as PermanentError when retrying cannot help until someone acts
(EACCES, EPERM, EROFS, ENOSPC, EDQUOT and the namespace conflicts ENOTDIR,
EISDIR, ENOTEMPTY, EEXIST...), TransientError otherwise (EIO, ESTALE, ...).
Reading a missing file (or a directory) raises ``NotFoundError`` (a PermanentError
with errno ENOENT), in every store.
"""
from __future__ import annotations

import errno
from errno import ENOENT
import os
import stat as _stat
import uuid
from contextlib import contextmanager
from typing import Callable, Iterator
from urllib.parse import unquote, urlsplit

from acache.data.under.base import UEntry, rename_needed
from acache.errors import ConfigError, PermanentError, TransientError, UnderStoreError

TMP_PREFIX = ".acache-tmp."
CHUNK = 4 << 20  # bytes copied per call (and per progress report)

_PERMANENT_ERRNOS = frozenset({
    errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT,
    errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.ENOTEMPTY,
    errno.EEXIST, errno.EINVAL, errno.ELOOP, errno.EXDEV,
})
# copy_file_range / sendfile not possible here: fall back to the next method
_NO_FAST_COPY = frozenset({errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP,
                           errno.EINVAL, errno.EBADF, errno.ENOTSUP})


class NotFoundError(PermanentError):
    """read() of a missing file.  An UnderStoreError (callers retrying a read after a
    rename catch it as one) whose errno is ENOENT (the FUSE edge answers that)."""
    errno = ENOENT


def clean_path(path: str, what: str = "path") -> str:
    """Check a store path (see base.py); '' is the root.

    Raises PermanentError for anything that could escape the store's root or
    prefix: absolute paths, '.', '..' or empty parts, NUL bytes.
    """
    if not isinstance(path, str):
        raise PermanentError(f"under-store {what} must be a str, not {type(path).__name__}")
    if path and (path.startswith("/") or "\0" in path
                 or any(p in ("", ".", "..") for p in path.split("/"))):
        raise PermanentError(
            f"invalid under-store {what} {path!r}: it must be relative and '/'-separated, "
            "with no '.', '..' or empty parts")
    return path


def parent_of(path: str) -> str:
    return path.rpartition("/")[0]


def name_of(path: str) -> str:
    return path.rpartition("/")[2]


def os_error(e: OSError, what: str) -> UnderStoreError:
    """The one OSError -> UnderStoreError table of this module."""
    name = errno.errorcode.get(e.errno or 0, str(e.errno))
    msg = f"{what}: [{name}] {e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    return PermanentError(msg) if e.errno in _PERMANENT_ERRNOS else TransientError(msg)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_range(src_fd: int, dst_fd: int, size: int,
               progress: Callable[[int], None] | None = None) -> None:
    """Copy ``size`` bytes from offset 0 of src to offset 0 of dst, in kernel when possible."""
    off, method = 0, "copy_file_range"
    while off < size:
        n = min(CHUNK, size - off)
        try:
            if method == "copy_file_range":
                done = os.copy_file_range(src_fd, dst_fd, n, off, off)
            elif method == "sendfile":
                done = os.sendfile(dst_fd, src_fd, off, n)  # writes at dst's position
            else:
                buf = memoryview(os.pread(src_fd, n, off))
                w = 0
                while w < len(buf):
                    w += os.pwrite(dst_fd, buf[w:], off + w)
                done = len(buf)
        except OSError as e:
            if method != "pread" and e.errno in _NO_FAST_COPY:
                method = "sendfile" if method == "copy_file_range" else "pread"
                os.lseek(dst_fd, off, os.SEEK_SET)
                continue
            raise
        if done == 0 and method != "pread":
            method = "pread"  # some filesystems answer 0 instead of an error: make sure
            continue
        if done == 0:
            raise PermanentError(f"source file ended at {off} bytes, expected {size}")
        off += done
        if progress is not None:
            progress(done)


class FileStore:
    """An UnderStore on a POSIX directory.  Thread-safe: it holds no mutable state."""

    atomic_dir_rename = True

    def __init__(self, url: str, **options):
        if options:
            raise ConfigError(f"file:// takes no options, got {sorted(options)}")
        parts = urlsplit(url)
        if parts.scheme != "file" or parts.netloc not in ("", "localhost") \
                or not parts.path.startswith("/"):
            raise ConfigError(f"bad file:// URL {url!r}: expected file:///absolute/dir")
        self.url = url
        self.root = os.path.normpath(unquote(parts.path))
        try:  # best effort; check() reports why it failed
            os.makedirs(self.root, exist_ok=True)
        except OSError:
            pass

    # -- helpers -----------------------------------------------------------
    def _abs(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    @contextmanager
    def _errors(self, op: str, path: str):
        try:
            yield
        except OSError as e:
            raise os_error(e, f"file://{self.root} {op} {path!r}") from e

    def _makedirs(self, path: str) -> None:
        """Create root/path and its parents; fsync the parent of each one created."""
        full = self._abs(path)
        if os.path.isdir(full):
            return
        cur = self.root
        os.makedirs(cur, exist_ok=True)
        for part in path.split("/") if path else ():
            nxt = os.path.join(cur, part)
            try:
                os.mkdir(nxt)
            except FileExistsError:
                if not os.path.isdir(nxt):
                    raise NotADirectoryError(errno.ENOTDIR, "not a directory", nxt) from None
            # fsync also when another thread won the race: its entry must be durable
            # before anything we put below it claims to be.
            _fsync_dir(cur)
            cur = nxt

    def _token_path(self, token: str) -> str:
        clean_path(token, "token")
        if not token or not name_of(token).startswith(TMP_PREFIX) \
                or name_of(token) == TMP_PREFIX:
            raise PermanentError(f"not a file:// stage token: {token!r}")
        return token

    # -- UnderStore --------------------------------------------------------
    def check(self) -> None:
        probe = os.path.join(self.root, f"{TMP_PREFIX}check-{uuid.uuid4().hex}")
        try:
            os.makedirs(self.root, exist_ok=True)
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, b"acache")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise PermanentError(
                f"file:// under-storage {self.root} is not usable: cannot create or write "
                f"it: {e}") from e

    def list_dir(self, path: str) -> Iterator[UEntry]:
        clean_path(path)
        out = []
        with self._errors("list", path):
            try:
                it = os.scandir(self._abs(path))
            except (FileNotFoundError, NotADirectoryError):
                return iter(())
            with it:
                for e in it:
                    if e.name.startswith(TMP_PREFIX):
                        continue
                    try:
                        st = e.stat()
                    except (FileNotFoundError, NotADirectoryError):
                        continue  # raced with a delete, or a dangling symlink
                    ent = self._entry(e.name, st)
                    if ent is not None:
                        out.append(ent)
        out.sort(key=lambda u: u.name)
        return iter(out)

    @staticmethod
    def _entry(name: str, st: os.stat_result) -> UEntry | None:
        if _stat.S_ISDIR(st.st_mode):
            return UEntry(name, True, 0, st.st_mtime)
        if _stat.S_ISREG(st.st_mode):
            return UEntry(name, False, st.st_size, st.st_mtime)
        return None  # fifos, sockets, devices: not checkpoint data

    def stat(self, path: str) -> UEntry | None:
        clean_path(path)
        if name_of(path).startswith(TMP_PREFIX):
            return None
        with self._errors("stat", path):
            try:
                st = os.stat(self._abs(path))
            except (FileNotFoundError, NotADirectoryError):
                return None
        return self._entry(name_of(path), st)

    def read(self, path: str, offset: int, length: int) -> bytes:
        clean_path(path)
        if length <= 0:
            return b""
        with self._errors("read", path):
            try:
                fd = os.open(self._abs(path), os.O_RDONLY | os.O_CLOEXEC)
            except (FileNotFoundError, NotADirectoryError):
                raise NotFoundError(f"file://{self.root}: no file {path!r}") from None
            try:
                chunks, got = [], 0
                while got < length:
                    try:
                        buf = os.pread(fd, length - got, offset + got)
                    except IsADirectoryError:
                        raise NotFoundError(f"file://{self.root}: {path!r} is a directory") from None
                    if not buf:
                        break
                    chunks.append(buf)
                    got += len(buf)
                return b"".join(chunks)
            finally:
                os.close(fd)

    def new_token(self, path: str) -> str:
        clean_path(path)
        d = parent_of(path)
        name = TMP_PREFIX + uuid.uuid4().hex
        return f"{d}/{name}" if d else name

    def stage(self, path: str, token: str, src_path: str, size: int,
              progress: Callable[[int], None] | None = None) -> "FileStaged":
        clean_path(path)
        if not path:
            raise PermanentError("cannot stage onto the root directory")
        tmp = self._token_path(token)
        tmp_abs = self._abs(tmp)
        ok = False
        with self._errors("stage", path):
            try:
                self._makedirs(parent_of(tmp))
                src = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    dst = os.open(tmp_abs, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                                  0o644)
                    try:
                        copy_range(src, dst, size, progress)
                        os.fsync(dst)
                        ino = os.fstat(dst).st_ino
                    finally:
                        os.close(dst)
                finally:
                    os.close(src)
                ok = True
            finally:
                if not ok:
                    try:
                        os.unlink(tmp_abs)
                    except OSError:
                        pass
        return FileStaged(self, token, tmp, path, ino)

    def cleanup(self, token: str) -> None:
        tmp = self._token_path(token)
        with self._errors("cleanup", tmp):
            try:
                os.unlink(self._abs(tmp))
            except (FileNotFoundError, NotADirectoryError):
                pass

    def rename(self, src: str, dst: str) -> None:
        clean_path(src)
        clean_path(dst)
        if not rename_needed(src, dst):
            return
        a, b = self._abs(src), self._abs(dst)
        with self._errors("rename", f"{src} -> {dst}"):
            if not os.path.lexists(a):
                if os.path.lexists(b):  # done before (a retry after a crash)
                    _fsync_dir(os.path.dirname(b))
                    return
                raise PermanentError(
                    f"file://{self.root} rename {src!r} -> {dst!r}: neither exists")
            self._makedirs(parent_of(dst))
            os.rename(a, b)
            _fsync_dir(os.path.dirname(b))
            if os.path.dirname(a) != os.path.dirname(b):
                _fsync_dir(os.path.dirname(a))

    def delete(self, path: str) -> None:
        clean_path(path)
        if not path:
            raise PermanentError("cannot delete the root directory")
        with self._errors("delete", path):
            try:
                os.unlink(self._abs(path))
            except (FileNotFoundError, NotADirectoryError):
                return
            _fsync_dir(os.path.dirname(self._abs(path)))

    def mkdir(self, path: str) -> None:
        clean_path(path)
        with self._errors("mkdir", path):
            self._makedirs(path)

    def rmdir(self, path: str) -> None:
        clean_path(path)
        if not path:
            raise PermanentError("cannot remove the root directory")
        full = self._abs(path)
        with self._errors("rmdir", path):
            try:
                os.rmdir(full)
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                # Leftovers of stages whose file was since deleted do not keep it alive.
                names = os.listdir(full)
                if any(not n.startswith(TMP_PREFIX) for n in names):
                    raise
                for n in names:
                    try:
                        os.unlink(os.path.join(full, n))
                    except FileNotFoundError:
                        pass
                os.rmdir(full)
            _fsync_dir(os.path.dirname(full))

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"FileStore({self.url!r})"


class FileStaged:
    """A staged file: ``<root>/<token>`` holds the bytes, fsync'd."""

    def __init__(self, store: FileStore, token: str, tmp: str, path: str, ino: int):
        self.token = token
        self.path = path
        self._store = store
        self._tmp = tmp
        self._ino = ino  # tells "committed before" from "someone removed the temp file"

    def commit(self) -> None:
        st = self._store
        tmp_abs, final_abs = st._abs(self._tmp), st._abs(self.path)
        with st._errors("commit", self.path):
            st._makedirs(parent_of(self.path))
            try:
                os.rename(tmp_abs, final_abs)
            except FileNotFoundError:
                if os.path.lexists(tmp_abs):
                    raise
                try:
                    committed = os.stat(final_abs).st_ino == self._ino
                except FileNotFoundError:
                    committed = False
                if not committed:  # transient: the persister's retry stages again
                    raise TransientError(
                        f"file://{st.root} commit {self.path!r}: the staged temp file "
                        f"{self._tmp!r} is gone; stage again") from None
                # else: committed before (a retry after a crash); make it durable
            _fsync_dir(os.path.dirname(final_abs))
            if os.path.dirname(tmp_abs) != os.path.dirname(final_abs):
                _fsync_dir(os.path.dirname(tmp_abs))

    def abort(self) -> None:
        self._store.cleanup(self.token)
