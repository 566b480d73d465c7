"""The small Python API: a file's persistence state, and the durability barrier.

    >>> import acache
    >>> acache.file_state("/ckpt/step-100/model.pt")     # 'dirty' | 'persisting' | 'persisted' | 'failed'
    >>> acache.flush("/ckpt/step-100", timeout=600)       # raises FlushError unless all of it is persisted
"""
from __future__ import annotations

import os

STATE_XATTR = "user.acache.state"


def file_state(path: str | os.PathLike) -> str:
    """The persistence state of a file on an acache mount."""
    return os.getxattr(path, STATE_XATTR).decode()


def flush(path: str | os.PathLike | None = None, timeout: float | None = None,
          home: str | None = None) -> None:
    """Block until every byte written before the call (under ``path``) is in the
    under-storage.  Raises acache.errors.FlushError with the reason otherwise."""
    from acache.node.client import Client
    from acache.config import load
    settings = load(home=home)
    with Client(settings.socket_path) as c:
        c.flush(os.path.abspath(path) if path else None, timeout)
