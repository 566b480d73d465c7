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

Links are never followed.  Every path is resolved beneath the root without
following a symbolic link in any component (openat2 with RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS, or a walk of O_NOFOLLOW directory descriptors where the
kernel lacks openat2), and the last component is handled with *at() calls that
do not follow it either: a link planted in the under-storage is listed as a
link, and a path through one is refused (PermanentError, ELOOP).  Only the
configured root itself may be a link (the operator chose it).  Symbolic links
written through the mount are created at a hidden temp name and renamed into
place.  Attributes (mode, owner, mtime) are the files' own: set on the temp file
before the commit rename, on a directory after mkdir, with lchown/utime
(never following) on a link.  A daemon that may not chown keeps the owner it
has (one warning).

OSErrors leave as PermanentError when retrying cannot help until someone acts
(EACCES, EPERM, EROFS, ENOSPC, EDQUOT and the namespace conflicts ENOTDIR,
EISDIR, ENOTEMPTY, EEXIST...), TransientError otherwise (EIO, ESTALE, ...).
Reading a missing file (or a directory) raises ``NotFoundError`` (a PermanentError
with errno ENOENT), in every store.
"""
from __future__ import annotations

import ctypes
import errno
import logging
from errno import ENOENT
import os
import stat as _stat
import uuid
from contextlib import contextmanager
from typing import Callable, Iterator
from urllib.parse import unquote, urlsplit

from acache.data.under.base import Attrs, UEntry, bad_name, rename_needed
from acache.errors import ConfigError, PermanentError, TransientError, UnderStoreError

log = logging.getLogger("acache.under.file")
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
    if e.errno == errno.ELOOP:
        msg += " (a symbolic link in the under-storage path: acache never follows links there)"
    return PermanentError(msg) if e.errno in _PERMANENT_ERRNOS else TransientError(msg)


# openat2(2) (Linux >= 5.6): one call resolves a whole path beneath a directory
_SYS_OPENAT2 = 437               # the same number on x86_64 and the generic table (arm64)
_RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x04, 0x08
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC   # a FIFO must not block


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


_openat2_works = [True]   # False once the kernel said ENOSYS: walk instead


def _open_at(dirfd: int, name: str, flags: int) -> int:
    """openat(2) of one component, never following it: a link there is ELOOP (O_DIRECTORY
    alone would call it ENOTDIR, the same as a file)."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW, dir_fd=dirfd)
    except NotADirectoryError:
        try:
            link = _stat.S_ISLNK(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode)
        except OSError:
            link = False
        if link:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), name) from None
        raise


def open_beneath(dirfd: int, rel: str, flags: int = _DIR) -> int:
    """Open ``rel`` beneath ``dirfd`` without following a link in any component."""
    if _openat2_works[0]:
        how = _OpenHow(flags, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS)
        fd = _libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_long(dirfd),
                           ctypes.c_char_p(os.fsencode(rel)), ctypes.byref(how),
                           ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EPERM, errno.ENOTDIR):
            raise OSError(err, os.strerror(err), rel)    # EPERM: a seccomp filter refusing it
        if err != errno.ENOTDIR:                         # ENOTDIR: a file, or a link at the
            _openat2_works[0] = False                    # end: the walk tells which
    parts = rel.split("/")
    cur = os.dup(dirfd)
    try:
        for i, part in enumerate(parts):
            nxt = _open_at(cur, part, flags if i == len(parts) - 1 else _DIR)
            os.close(cur)
            cur = nxt
        return cur
    except BaseException:
        os.close(cur)
        raise


def _set_fd_attrs(fd: int, attrs: Attrs | None, what: str) -> None:
    """Apply ``attrs`` to an open file or directory (owner first: chown clears setuid)."""
    if attrs is None:
        return
    if attrs.uid >= 0 or attrs.gid >= 0:
        try:
            os.fchown(fd, attrs.uid, attrs.gid)
        except PermissionError:
            _warn_chown(what)
    if attrs.mode:
        os.fchmod(fd, attrs.mode & 0o7777)
    if attrs.mtime_ns:
        os.utime(fd, ns=(attrs.mtime_ns, attrs.mtime_ns))


_chown_warned = [False]


def _warn_chown(what: str) -> None:
    if not _chown_warned[0]:
        _chown_warned[0] = True
        log.warning("file:// cannot set the owner of %s (the daemon is not root?): owners are "
                    "not persisted", what)


def copy_range(src_fd: int, dst_fd: int, size: int,
               progress: Callable[[int], None] | None = None,
               take: Callable[[int], None] | None = None) -> None:
    """Copy ``size`` bytes from offset 0 of src to offset 0 of dst, in kernel when possible;
    ``take(n)`` before each chunk of ``n`` bytes (the bandwidth limit)."""
    off, method, paid = 0, "copy_file_range", 0
    while off < size:
        n = min(CHUNK, size - off)
        if take is not None and paid < off + n:
            take(off + n - paid)
            paid = off + n
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
        self._take: Callable[[int], None] | None = None
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

    def _open_dir(self, path: str) -> int | None:
        """A descriptor of the directory root/path (None if it is missing); no link is
        followed on the way (ELOOP)."""
        root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        if not path:
            return root
        try:
            return open_beneath(root, path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        finally:
            os.close(root)

    @contextmanager
    def _parent(self, path: str):
        """(descriptor of the parent directory or None if missing, last component)."""
        fd = self._open_dir(parent_of(path))
        try:
            yield fd, name_of(path)
        finally:
            if fd is not None:
                os.close(fd)

    def _makedirs(self, path: str) -> int:
        """Create root/path and its parents (never through a link); fsync the parent of
        each one created.  Returns a descriptor of root/path."""
        fd = self._open_dir(path)
        if fd is not None:
            return fd
        os.makedirs(self.root, exist_ok=True)
        cur = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in path.split("/") if path else ():
                try:
                    os.mkdir(part, 0o755, dir_fd=cur)
                except FileExistsError:
                    pass
                # fsync also when another thread won the race: its entry must be durable
                # before anything we put below it claims to be.
                os.fsync(cur)
                nxt = _open_at(cur, part, _DIR)
                os.close(cur)
                cur = nxt
            return cur
        except BaseException:
            os.close(cur)
            raise

    @staticmethod
    def _lstat(dfd: int | None, name: str) -> os.stat_result | None:
        if dfd is None:
            return None
        try:
            return os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _token_path(self, token: str) -> str:
        clean_path(token, "token")
        if not token or not name_of(token).startswith(TMP_PREFIX) \
                or name_of(token) == TMP_PREFIX:
            raise PermanentError(f"not a file:// stage token: {token!r}")
        return token

    # -- UnderStore --------------------------------------------------------
    def check(self) -> None:
        probe = f"{TMP_PREFIX}check-{uuid.uuid4().hex}"
        try:
            os.makedirs(self.root, exist_ok=True)
            root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600, dir_fd=root)
                try:
                    os.write(fd, b"acache")
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.unlink(probe, dir_fd=root)
            finally:
                os.close(root)
        except OSError as e:
            raise PermanentError(
                f"file:// under-storage {self.root} is not usable: cannot create or write "
                f"it: {e}") from e

    def list_dir(self, path: str) -> Iterator[UEntry]:
        clean_path(path)
        out = []
        with self._errors("list", path):
            fd = self._open_dir(path)
            if fd is None:
                return iter(())
            try:
                with os.scandir(fd) as it:
                    for e in it:
                        if e.name.startswith(TMP_PREFIX):
                            continue
                        why = bad_name(e.name)
                        if why is not None:
                            log.warning("file://%s: skipping %r in %r: %s", self.root, e.name,
                                        path, why)
                            continue
                        try:
                            ent = self._entry(e.name, e.stat(follow_symlinks=False), fd)
                        except (FileNotFoundError, NotADirectoryError):
                            continue  # raced with a delete
                        if ent is not None:
                            out.append(ent)
            finally:
                os.close(fd)
        out.sort(key=lambda u: u.name)
        return iter(out)

    @staticmethod
    def _entry(name: str, st: os.stat_result, dfd: int) -> UEntry | None:
        def entry(is_dir: bool, size: int, link: str | None = None) -> UEntry:
            return UEntry(name, is_dir, size, st.st_mtime, mode=_stat.S_IMODE(st.st_mode),
                          uid=st.st_uid, gid=st.st_gid, mtime_ns=st.st_mtime_ns, link=link)
        if _stat.S_ISDIR(st.st_mode):
            return entry(True, 0)
        if _stat.S_ISREG(st.st_mode):
            return entry(False, st.st_size)
        if _stat.S_ISLNK(st.st_mode):
            target = os.readlink(name, dir_fd=dfd)
            return entry(False, len(os.fsencode(target)), target)
        return None  # fifos, sockets, devices: not checkpoint data

    def stat(self, path: str) -> UEntry | None:
        clean_path(path)
        if name_of(path).startswith(TMP_PREFIX):
            return None
        with self._errors("stat", path):
            if not path:
                return UEntry("", True, 0, os.stat(self.root).st_mtime)
            with self._parent(path) as (dfd, name):
                st = self._lstat(dfd, name)
                if st is None:
                    return None
                try:
                    return self._entry(name, st, dfd)
                except FileNotFoundError:
                    return None

    def read(self, path: str, offset: int, length: int) -> bytes:
        clean_path(path)
        if length <= 0:
            return b""
        with self._errors("read", path):
            with self._parent(path) as (dfd, name):
                try:
                    if dfd is None or not path:
                        raise FileNotFoundError
                    fd = os.open(name, _FILE, dir_fd=dfd)
                except (FileNotFoundError, NotADirectoryError):
                    raise NotFoundError(f"file://{self.root}: no file {path!r}") from None
            try:
                if not _stat.S_ISREG(os.fstat(fd).st_mode):
                    raise NotFoundError(f"file://{self.root}: {path!r} is not a regular file")
                chunks, got = [], 0
                while got < length:
                    buf = os.pread(fd, length - got, offset + got)
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

    def local_stage(self, size: int) -> bool:
        return False      # a stage copies the bytes into a temp file in the directory

    def stage(self, path: str, token: str, src_path: str, size: int,
              progress: Callable[[int], None] | None = None,
              attrs: Attrs | None = None,
              on_token: Callable[[str], None] | None = None) -> "FileStaged":
        clean_path(path)
        if not path:
            raise PermanentError("cannot stage onto the root directory")
        tmp = self._token_path(token)
        tname = name_of(tmp)
        with self._errors("stage", path):
            dfd = self._makedirs(parent_of(tmp))
            ok = False
            try:
                src = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    # private while it fills: a 0600 file is never readable on the way
                    dst = os.open(tname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                                  | os.O_CLOEXEC, 0o600, dir_fd=dfd)
                    try:
                        copy_range(src, dst, size, progress, self._take)
                        if attrs is None or not attrs.mode:
                            os.fchmod(dst, 0o644)
                        _set_fd_attrs(dst, attrs, path)
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
                        os.unlink(tname, dir_fd=dfd)
                    except OSError:
                        pass
                os.close(dfd)
        return FileStaged(self, token, tmp, path, ino)

    # -- a stage made by another node on the same directory (a cluster's holder of the
    # file writes the temp file from its own cache; the head commits it in order)
    def staged_from(self, token: str, path: str, made: dict) -> "FileStaged":
        """The stage another node made with stage(path, token, ...): ``made`` is its
        FileStaged.made() (the temp file's inode, to tell a commit done before)."""
        clean_path(path)
        ino = made.get("ino")
        if not path or not isinstance(ino, int):
            raise PermanentError(f"file://{self.root}: bad stage of {path!r} from another node")
        return FileStaged(self, token, self._token_path(token), path, ino)

    def cleanup(self, token: str) -> None:
        tmp = self._token_path(token)
        with self._errors("cleanup", tmp):
            with self._parent(tmp) as (dfd, name):
                if dfd is None:
                    return
                try:
                    os.unlink(name, dir_fd=dfd)
                except (FileNotFoundError, NotADirectoryError):
                    pass

    def rename(self, src: str, dst: str) -> None:
        clean_path(src)
        clean_path(dst)
        if not rename_needed(src, dst):
            return
        with self._errors("rename", f"{src} -> {dst}"), self._parent(src) as (sfd, sname):
            if self._lstat(sfd, sname) is None:
                with self._parent(dst) as (dfd, dname):
                    if self._lstat(dfd, dname) is not None:  # done before (a retry after a crash)
                        os.fsync(dfd)
                        return
                raise PermanentError(
                    f"file://{self.root} rename {src!r} -> {dst!r}: neither exists")
            dfd = self._makedirs(parent_of(dst))
            try:
                os.rename(sname, name_of(dst), src_dir_fd=sfd, dst_dir_fd=dfd)
                os.fsync(dfd)
                if parent_of(src) != parent_of(dst):
                    os.fsync(sfd)
            finally:
                os.close(dfd)

    def delete(self, path: str) -> None:
        clean_path(path)
        if not path:
            raise PermanentError("cannot delete the root directory")
        with self._errors("delete", path), self._parent(path) as (dfd, name):
            if dfd is None:
                return
            try:
                os.unlink(name, dir_fd=dfd)
            except (FileNotFoundError, NotADirectoryError):
                return
            os.fsync(dfd)

    def mkdir(self, path: str, attrs: Attrs | None = None) -> None:
        clean_path(path)
        with self._errors("mkdir", path):
            fd = self._makedirs(path)
            try:
                if path and attrs is not None:
                    _set_fd_attrs(fd, attrs, path)
                    os.fsync(fd)
            finally:
                os.close(fd)

    def symlink(self, path: str, target: str, attrs: Attrs | None = None) -> None:
        clean_path(path)
        if not path:
            raise PermanentError("cannot make the root directory a symbolic link")
        if not target or "\0" in target:
            raise PermanentError(f"file:// symlink {path!r}: invalid target {target!r}")
        tmp = TMP_PREFIX + uuid.uuid4().hex
        with self._errors("symlink", path):
            dfd = self._makedirs(parent_of(path))
            try:
                os.symlink(target, tmp, dir_fd=dfd)
                try:
                    self._link_attrs(dfd, tmp, attrs, path)
                    os.rename(tmp, name_of(path), src_dir_fd=dfd, dst_dir_fd=dfd)
                except BaseException:
                    try:
                        os.unlink(tmp, dir_fd=dfd)
                    except OSError:
                        pass
                    raise
                os.fsync(dfd)
            finally:
                os.close(dfd)

    @staticmethod
    def _link_attrs(dfd: int, name: str, attrs: Attrs | None, what: str) -> None:
        """Owner and mtime of a link itself (a link's mode cannot be changed on Linux)."""
        if attrs is None:
            return
        if attrs.uid >= 0 or attrs.gid >= 0:
            try:
                os.chown(name, attrs.uid, attrs.gid, dir_fd=dfd, follow_symlinks=False)
            except PermissionError:
                _warn_chown(what)
        if attrs.mtime_ns:
            os.utime(name, ns=(attrs.mtime_ns, attrs.mtime_ns), dir_fd=dfd,
                     follow_symlinks=False)

    def set_attrs(self, path: str, attrs: Attrs) -> None:
        clean_path(path)
        if not path:
            return   # the root's attributes belong to the operator
        with self._errors("set_attrs", path), self._parent(path) as (dfd, name):
            st = self._lstat(dfd, name)
            if st is None:
                log.info("file://%s: %r is gone: its attributes cannot be set", self.root, path)
                return
            if _stat.S_ISLNK(st.st_mode):
                self._link_attrs(dfd, name, attrs, path)
                os.fsync(dfd)
                return
            try:
                fd = os.open(name, _FILE, dir_fd=dfd)
            except FileNotFoundError:
                return
            try:
                _set_fd_attrs(fd, attrs, path)
                os.fsync(fd)
            finally:
                os.close(fd)

    def rmdir(self, path: str) -> None:
        clean_path(path)
        if not path:
            raise PermanentError("cannot remove the root directory")
        with self._errors("rmdir", path), self._parent(path) as (dfd, name):
            if dfd is None:
                return
            try:
                os.rmdir(name, dir_fd=dfd)
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                # Leftovers of stages whose file was since deleted do not keep it alive.
                fd = _open_at(dfd, name, _DIR)
                try:
                    names = os.listdir(fd)
                    if any(not n.startswith(TMP_PREFIX) for n in names):
                        raise
                    for n in names:
                        try:
                            os.unlink(n, dir_fd=fd)
                        except FileNotFoundError:
                            pass
                finally:
                    os.close(fd)
                os.rmdir(name, dir_fd=dfd)
            os.fsync(dfd)

    def set_limiter(self, take: Callable[[int], None] | None) -> None:
        self._take = take

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

    def made(self) -> dict:
        """What another node's FileStore.staged_from needs to commit this stage."""
        return {"ino": self._ino}

    def commit(self) -> None:
        st = self._store
        with st._errors("commit", self.path), st._parent(self._tmp) as (tfd, tname):
            dfd = st._makedirs(parent_of(self.path))
            try:
                try:
                    if tfd is None:
                        raise FileNotFoundError
                    os.rename(tname, name_of(self.path), src_dir_fd=tfd, dst_dir_fd=dfd)
                except FileNotFoundError:
                    if st._lstat(tfd, tname) is not None:
                        raise
                    final = st._lstat(dfd, name_of(self.path))
                    if final is None or final.st_ino != self._ino:
                        # transient: the persister's retry stages again
                        raise TransientError(
                            f"file://{st.root} commit {self.path!r}: the staged temp file "
                            f"{self._tmp!r} is gone; stage again") from None
                    # else: committed before (a retry after a crash); make it durable
                os.fsync(dfd)
                if tfd is not None and parent_of(self._tmp) != parent_of(self.path):
                    os.fsync(tfd)
            finally:
                os.close(dfd)

    def abort(self) -> None:
        self._store.cleanup(self.token)
