"""One settings object: built-in defaults < config file (TOML) < env (ACACHE_*) < flags.

    home        = ACACHE_HOME or ~/.local/state/acache   (socket, log, default config)
    cache_dir   = <home>/cache                            (cache files + meta/ RocksDB)
    ufs         = file://<home>/ufs                       (the under-storage)
    cache_size  = "auto" (half of the cache filesystem) or bytes / "20GiB"
    engine      = auto | native | pyfuse3
    passthrough = true: the native engine uses kernel passthrough where it can (false: never)
    flush_delay = 1.0 s before a closed file starts persisting
    stall_timeout = 300 s a writer waits for dirty space before ENOSPC
    chunk_size  = 8 MiB read-through fetch unit
    upload_concurrency = 4 files staged in parallel
    [s3] endpoint, region, access_key, secret_key, session_token, addressing, part_size,
         multipart_threshold, concurrency, content_md5, verify_tls, connect_timeout,
         read_timeout
         (acache.data.under.s3); ACACHE_S3_<KEY> over the file's table
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable

from acache.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
          "tib": 1 << 40}
S3_KEYS = {"endpoint", "region", "access_key", "secret_key", "session_token", "addressing",
           "part_size", "multipart_threshold", "concurrency", "content_md5", "verify_tls",
           "connect_timeout", "read_timeout"}


def parse_size(value: object, what: str = "size") -> int:
    """'20GiB' / '512m' / 1048576 -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{what}: cannot read {value!r} as a size (e.g. 20GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def default_home() -> Path:
    env = os.environ.get("ACACHE_HOME")
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "acache"


@dataclass(frozen=True)
class Settings:
    home: Path = field(default_factory=default_home)
    cache_dir: Path | None = None
    ufs: str | None = None
    cache_size: int | None = None          # None = auto
    engine: str = "auto"
    passthrough: bool = True
    flush_delay: float = 1.0
    stall_timeout: float = 300.0
    chunk_size: int = 8 << 20
    upload_concurrency: int = 4
    log_level: str = "INFO"
    s3: dict = field(default_factory=dict)

    # -- derived -----------------------------------------------------------------
    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else self.home / "cache"

    @property
    def ufs_url(self) -> str:
        return self.ufs or f"file://{self.home / 'ufs'}"

    @property
    def socket_path(self) -> Path:
        path = self.home / "acache.sock"
        if len(str(path).encode()) < 100:      # unix socket paths are limited to 108 bytes
            return path
        digest = hashlib.sha1(str(self.home).encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"acache-{digest}.sock"

    @property
    def log_path(self) -> Path:
        return self.home / "acache.log"

    def resolved_cache_size(self) -> int:
        if self.cache_size:
            return self.cache_size
        st = os.statvfs(self.cache_path if self.cache_path.exists() else self.home)
        return st.f_blocks * st.f_frsize // 2

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["home"] = str(self.home)
        d["cache_dir"] = str(self.cache_path)
        d["ufs"] = self.ufs_url
        return d


def parse_bool(value: object, what: str) -> bool:
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{what}: expected true or false, not {value!r}")


_CASTS: dict[str, Callable[[Any], object]] = {
    "home": Path, "cache_dir": Path, "ufs": str, "engine": str, "log_level": str,
    "cache_size": lambda v: None if str(v) == "auto" else parse_size(v, "cache_size"),
    "passthrough": lambda v: parse_bool(v, "passthrough"),
    "flush_delay": float, "stall_timeout": float, "upload_concurrency": int,
    "chunk_size": lambda v: parse_size(v, "chunk_size"),
}


def _cast(key: str, value: object, where: str) -> object:
    try:
        out = _CASTS[key](value)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: bad value {value!r} for {key}") from None
    if key == "engine" and out not in ("auto", "native", "pyfuse3"):
        raise ConfigError(f"{where}: engine must be auto, native or pyfuse3, not {out!r}")
    return out


def _line_of(text: str, key: str) -> int:
    for i, line in enumerate(text.splitlines(), 1):
        if re.match(rf"\s*{re.escape(key)}\s*=", line) or line.strip() == f"[{key}]":
            return i
    return 0


def read_file(path: Path) -> dict:
    """Parse a TOML config file; every error names the file (and line)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    out: dict = {}
    for key, value in raw.items():
        where = f"config file {path}, line {_line_of(text, key)}"
        if key == "s3":
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: [s3] must be a table")
            bad = set(value) - S3_KEYS
            if bad:
                k = sorted(bad)[0]
                raise ConfigError(f"config file {path}, line {_line_of(text, k)}: unknown s3 key {k!r} "
                                  f"(known: {', '.join(sorted(S3_KEYS))})")
            out["s3"] = dict(value)
        elif key in _CASTS:
            out[key] = _cast(key, value, where)
        else:
            raise ConfigError(f"{where}: unknown key {key!r} "
                              f"(known: {', '.join(sorted([*_CASTS, 's3']))})")
    return out


def load(config: Path | None = None, **flags) -> Settings:
    """defaults < file < env < flags (flags that are None are ignored)."""
    values: dict = {}
    home = flags.get("home") or os.environ.get("ACACHE_HOME")
    cfg = config or os.environ.get("ACACHE_CONFIG")
    if cfg is None:
        candidate = (Path(home) if home else default_home()) / "config.toml"
        cfg = candidate if candidate.exists() else None
    if cfg is not None:
        values.update(read_file(Path(cfg)))
    for key in _CASTS:
        env = os.environ.get(f"ACACHE_{key.upper()}")
        if env not in (None, ""):
            values[key] = _cast(key, env, f"environment ACACHE_{key.upper()}")
    s3_env = {k: os.environ[f"ACACHE_S3_{k.upper()}"] for k in S3_KEYS
              if os.environ.get(f"ACACHE_S3_{k.upper()}")}
    if s3_env:   # env over the file here too; credentials go together (never mixed)
        s3 = dict(values.get("s3") or {})
        if "access_key" in s3_env:
            for k in ("access_key", "secret_key", "session_token"):
                s3.pop(k, None)
        values["s3"] = {**s3, **s3_env}
    for key, value in flags.items():
        if value is not None:
            values[key] = _cast(key, value, f"--{key.replace('_', '-')}") if key in _CASTS else value
    s = Settings(**values)
    if s.flush_delay < 0 or s.stall_timeout <= 0 or s.upload_concurrency < 1:
        raise ConfigError("flush_delay must be >= 0, stall_timeout > 0, upload_concurrency >= 1")
    return replace(s, home=Path(s.home))
