"""Under-storage backends, registered by URL scheme and imported lazily."""
from __future__ import annotations

import importlib

from acache.data.under.base import Staged, UEntry, UnderStore
from acache.errors import ConfigError

# scheme -> (module, factory, install hint)
_REGISTRY: dict[str, tuple[str, str, str]] = {
    "file": ("acache.data.under.file", "FileStore", ""),
    "mem": ("acache.data.under.mem", "MemStore", ""),
    "s3": ("acache.data.under.s3", "S3Store", "pip install minio"),
}


def open_store(url: str, options: dict | None = None) -> UnderStore:
    """Open the under-store for ``url`` (file:///dir, s3://bucket/prefix, mem://name)."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in _REGISTRY:
        raise ConfigError(f"unsupported under-storage URL {url!r} "
                          f"(expected one of: {', '.join(s + '://' for s in _REGISTRY)})")
    module, factory, hint = _REGISTRY[scheme]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ConfigError(f"{scheme}:// needs an extra package ({hint}): {e}") from e
    return getattr(mod, factory)(url, **(options or {}))


__all__ = ["open_store", "UnderStore", "UEntry", "Staged"]
