"""Under-storage backends, registered by URL scheme and imported lazily."""
from __future__ import annotations

import importlib
import os
import re
from urllib.parse import urlsplit

from acache.data.under.base import Staged, UEntry, UnderStore
from acache.errors import ConfigError

# scheme -> (module, factory, install hint)
_REGISTRY: dict[str, tuple[str, str, str]] = {
    "file": ("acache.data.under.file", "FileStore", ""),
    "mem": ("acache.data.under.mem", "MemStore", ""),
    "s3": ("acache.data.under.s3", "S3Store", "pip install minio"),
}


# mem:// keeps everything in the daemon's memory: gone at the next stop.  A node refuses it
# unless this variable is 1 (tests only).
VOLATILE_ENV = "ACACHE_TEST_ALLOW_MEM_UFS"

# S3's bucket naming rules: 3-63 characters of a-z 0-9 . -, starting and ending with a letter
# or digit, not an IP address, no "..", no reserved prefix/suffix
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_BUCKET_RESERVED = (("xn--", "sthree-", "amzn-s3-demo-"), ("-s3alias", "--ol-s3", ".mrap", "--x-s3"))


def check_url(url: str, node: bool = False) -> None:
    """Check an under-storage URL's form without opening it (ConfigError says what is wrong).
    ``node``: for a node's under-storage, which must keep data (no mem://)."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in _REGISTRY:
        raise ConfigError(f"unsupported under-storage URL {url!r} "
                          f"(expected one of: {', '.join(s + '://' for s in _REGISTRY)})")
    parts = urlsplit(url)
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/") \
                or parts.query or parts.fragment:
            raise ConfigError(f"bad file:// URL {url!r}: expected file:///absolute/dir")
    elif scheme == "s3":
        bucket = parts.netloc
        if not bucket or parts.query or parts.fragment:
            raise ConfigError(f"bad s3:// URL {url!r}: expected s3://bucket/prefix")
        if not _BUCKET.fullmatch(bucket) or ".." in bucket \
                or re.fullmatch(r"\d+\.\d+\.\d+\.\d+", bucket) \
                or bucket.startswith(_BUCKET_RESERVED[0]) or bucket.endswith(_BUCKET_RESERVED[1]):
            raise ConfigError(f"bad s3:// URL {url!r}: {bucket!r} is not a valid bucket name "
                              "(3-63 characters: lowercase letters, digits, '.' and '-', "
                              "starting and ending with a letter or digit)")
    elif scheme == "mem" and node and os.environ.get(VOLATILE_ENV) != "1":
        raise ConfigError("mem:// keeps data in memory only and loses it at the next "
                          "stop; it is for tests (file:///dir or s3://bucket/prefix)")


def open_store(url: str, options: dict | None = None) -> UnderStore:
    """Open the under-store for ``url`` (file:///dir, s3://bucket/prefix, mem://name)."""
    check_url(url)
    scheme = url.partition("://")[0]
    module, factory, hint = _REGISTRY[scheme]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ConfigError(f"{scheme}:// needs an extra package ({hint}): {e}") from e
    return getattr(mod, factory)(url, **(options or {}))


__all__ = ["open_store", "check_url", "UnderStore", "UEntry", "Staged"]
