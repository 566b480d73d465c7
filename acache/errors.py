"""The error tree.  Translation happens only at the edges (OS/S3 errors in the
under-stores, FUSE replies in the engines, exit codes in the CLI).

    AcacheError                    errno   retryable
    ├── ConfigError                EINVAL  no     bad config file / flag / URL
    ├── FsError                    (given) no     a POSIX error for the mount (ENOENT, EEXIST...)
    │   └── MetaError              EIO     no     a metadata write failed: the operation is undone
    │       └── EtcdError          EIO     no     etcd refused a request (acache.meta.etcd)
    │           └── CompactedError EIO     no     a watch/read from a compacted revision
    ├── UnderStoreError            EIO     (given) the under-storage failed
    │   ├── TransientError         EIO     yes    5xx, SlowDown, timeouts, connection refused
    │   └── PermanentError         EIO     no     AccessDenied, NoSuchBucket, bad credentials, EACCES
    ├── DaemonError                        no     the CLI cannot reach / talk to the node daemon
    ├── FlushError                         no     `flush --wait` did not reach its barrier
    └── TransportError                     (...)  the peer transport: its own tree in acache.net.transport
"""
from __future__ import annotations

import errno as _errno


class AcacheError(Exception):
    errno: int = _errno.EIO
    retryable: bool = False


class ConfigError(AcacheError):
    errno = _errno.EINVAL


class FsError(AcacheError):
    """A POSIX error to hand back to the kernel, e.g. ``FsError(errno.ENOENT)``."""

    def __init__(self, err: int, msg: str = ""):
        super().__init__(msg or _errno.errorcode.get(err, str(err)))
        self.errno = err


class NewFile(FsError):
    """A write open asked to keep its generation's file (``same_file``) would need a new
    generation: refused before anything changed."""

    def __init__(self) -> None:
        super().__init__(_errno.EBUSY, "a write open needs a new generation")


class MetaError(FsError):
    """The metadata store could not write an operation's batch: nothing of it was applied
    (memory is back to what the store holds), and the mount answers EIO."""

    def __init__(self, msg: str):
        super().__init__(_errno.EIO, msg)


class UnderStoreError(AcacheError):
    def __init__(self, msg: str, retryable: bool = True):
        super().__init__(msg)
        self.retryable = retryable


class TransientError(UnderStoreError):
    def __init__(self, msg: str):
        super().__init__(msg, retryable=True)


class PermanentError(UnderStoreError):
    def __init__(self, msg: str):
        super().__init__(msg, retryable=False)


class DaemonError(AcacheError):
    pass


class FlushError(AcacheError):
    pass
