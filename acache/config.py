"""One settings object: built-in defaults < config file (TOML) < env (ACACHE_*) < flags.

    home        = ACACHE_HOME or ~/.local/state/acache   (socket, log, default config)
    cache_dir   = <home>/cache                            (cache files + meta/ RocksDB)
    ufs         = file://<home>/ufs                       (the under-storage)
    cache_size  = "auto" (half of the cache filesystem) or bytes / "20GiB"
    engine      = auto | native | pyfuse3
    passthrough = true: the native engine uses kernel passthrough where it can (false: never)
    flush_delay = 1.0 s before a closed file starts persisting
    stall_timeout = 300 s a writer waits for dirty space before ENOSPC
    meta_reserve = 64 MiB kept free for the metadata on the cache filesystem (acache.meta.reserve)
    chunk_size  = 8 MiB read-through fetch unit
    upload_concurrency = 4 files staged in parallel
    listen      = host:port the peer server binds (none: no peer server); advertise = host:port
                  peers dial (default: listen); secret_file = the cluster secret (mode 600),
                  required unless listen and advertise are loopback (acache.net.auth)
    upload_limit = "off" | "200MiB/s" | "08:00,100MiB/s 20:00,off" (acache.data.limit)
    metrics     = "" (off) | "127.0.0.1:9567": Prometheus text at http://HOST:PORT/metrics
    transport   = auto (RDMA to each peer where both sides can, else TCP) | tcp | rdma (a usable
                  RDMA device is required to start; peers without one still get TCP)
                  (acache.net.rdma)
    meta        = "" (single-host, the embedded RocksDB) | "etcd://h1:2379,h2:2379/NAME": a member
                  of cluster NAME, its namespace in etcd (acache.cluster); needs listen
    node_id     = this node's name in the cluster (default: the host name)
    placement   = local (a cluster node's files are written into its own cache: a *worker*) |
                  hash (a node without a cache: each file it writes is placed on a live worker
                  by rendezvous hashing of its inode; `acache mount --no-cache`); needs meta
                  (acache.cluster.cacheless)
    [s3] endpoint, region, access_key, secret_key, session_token, addressing, part_size,
         multipart_threshold, concurrency, content_md5, verify_tls, connect_timeout,
         read_timeout
         (acache.data.under.s3); ACACHE_S3_<KEY> over the file's table
"""
from __future__ import annotations

import hashlib
import math
import os
import re
import tempfile
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import unquote, urlsplit

from acache import units
from acache.errors import ConfigError

S3_KEYS = {"endpoint", "region", "access_key", "secret_key", "session_token", "addressing",
           "part_size", "multipart_threshold", "concurrency", "content_md5", "verify_tls",
           "connect_timeout", "read_timeout"}


_Bad = units.Bad          # the settings' own names for the shared size syntax
_size = units.size


def parse_size(value: object, what: str = "size") -> int:
    """'20GiB' / '512m' / 1048576 -> bytes."""
    try:
        return _size(value)
    except _Bad as e:
        raise ConfigError(f"{what}: {value!r}: {e}") from None


def human_size(n: float) -> str:
    """Bytes for people: 512 B, 1.5 MiB, 2.0 GiB (status, watch, flush progress)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


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
    meta_reserve: int = 64 << 20
    chunk_size: int = 8 << 20
    upload_concurrency: int = 4
    log_level: str = "INFO"
    listen: str | None = None
    advertise: str | None = None
    secret_file: Path | None = None
    upload_limit: str = "off"
    metrics: str = ""
    transport: str = "auto"
    meta: str = ""
    node_id: str = ""
    placement: str = "local"
    s3: dict = field(default_factory=dict)
    # key -> where its value came from ("config file X, line N", "environment ACACHE_X", "--x")
    sources: dict = field(default_factory=dict, compare=False, repr=False)

    def source(self, key: str) -> str:
        return self.sources.get(key, "default")

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



def _bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise _Bad("expected true or false")


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _Bad("expected a number")
    try:
        return float(value)
    except ValueError:
        raise _Bad("expected a number") from None


def _seconds(value: object) -> float:
    """A duration: a finite number of seconds >= 0."""
    v = _number(value)
    if not math.isfinite(v) or v < 0:
        raise _Bad("expected a finite number of seconds >= 0")
    return v


def _positive_seconds(value: object) -> float:
    v = _seconds(value)
    if v == 0:
        raise _Bad("expected a finite number of seconds > 0")
    return v


MAX_UPLOAD_CONCURRENCY = 256


def _concurrency(value: object) -> int:
    v = _number(value)
    if not v.is_integer() or not 1 <= v <= MAX_UPLOAD_CONCURRENCY:
        raise _Bad(f"expected a whole number from 1 to {MAX_UPLOAD_CONCURRENCY}")
    return int(v)


MIN_CHUNK, MAX_CHUNK, MIN_CACHE = 4 << 10, 1 << 30, 1 << 20


def _chunk(value: object) -> int:
    v = _size(value)
    if v < MIN_CHUNK or v > MAX_CHUNK or v % MIN_CHUNK:
        raise _Bad("expected a multiple of 4 KiB from 4 KiB to 1 GiB (e.g. 8MiB)")
    return v


def _cache_size(value: object) -> int | None:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    v = _size(value)
    if v < MIN_CACHE:
        raise _Bad('expected "auto" or a size of at least 1 MiB (e.g. 50GiB)')
    return v


def _path(value: object) -> Path:
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip() or "\0" in str(value):
        raise _Bad("expected a directory path")
    return Path(os.path.expanduser(str(value))).absolute()


def _choice(*allowed: str):
    def cast(value: object) -> str:
        v = str(value).strip() if isinstance(value, str) else None
        if v not in allowed:
            raise _Bad(f"expected one of {', '.join(allowed)}")
        return v
    return cast


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(value: object) -> str:
    return _choice(*_LEVELS)(value.upper() if isinstance(value, str) else value)


def _ufs(value: object) -> str:
    if not isinstance(value, str):
        raise _Bad("expected a URL (file:///dir or s3://bucket/prefix)")
    from acache.data.under import check_url
    try:
        check_url(value, node=True)
    except ConfigError as e:
        raise _Bad(str(e)) from None
    return value


def _address(value: object, *, dial: bool = False) -> str:
    from acache.net.auth import parse_address
    try:
        host, port = parse_address(value)  # type: ignore[arg-type]
    except ValueError as e:
        raise _Bad(str(e)) from None
    if dial and (port == 0 or host in ("0.0.0.0", "::")):
        raise _Bad("peers must be able to dial it: a real host and a port from 1 to 65535")
    return str(value).strip()


def _secret_file(value: object) -> Path:
    from acache.net.auth import load_secret
    from acache.net.transport import AuthError
    p = _path(value)
    try:
        load_secret(p)
    except AuthError as e:
        raise _Bad(str(e).split(": ", 1)[-1]) from None
    return p
def _upload_limit(value: object) -> str:
    from acache.data.limit import LimitError, parse
    try:
        return parse(value).text
    except LimitError as e:
        raise _Bad(str(e)) from None


def _metrics(value: object) -> str:
    """'' / 'off' (no metrics), 'PORT', ':PORT', 'HOST:PORT' or '[v6]:PORT' -> 'host:port'."""
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise _Bad("expected HOST:PORT (e.g. 127.0.0.1:9567), or off")
    v = str(value).strip()
    if v.lower() in ("", "off", "none", "false", "0"):
        return ""
    m = re.fullmatch(r"(?:(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]*):)?(\d{1,5})", v)
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise _Bad("expected HOST:PORT with a port from 1 to 65535 (e.g. 127.0.0.1:9567), or off")
    host = (m.group(1) or "127.0.0.1").strip("[]")
    return f"[{host}]:{m.group(2)}" if ":" in host else f"{host}:{m.group(2)}"


def split_hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


_CASTS = {
    "home": _path, "cache_dir": _path, "ufs": _ufs,
    "engine": _choice("auto", "native", "pyfuse3"), "log_level": _log_level,
    "cache_size": _cache_size, "passthrough": _bool,
    "flush_delay": _seconds, "stall_timeout": _positive_seconds, "upload_concurrency": _concurrency,
    "chunk_size": _chunk,
    "meta_reserve": _size,
    "listen": _address, "advertise": lambda v: _address(v, dial=True), "secret_file": _secret_file,
    "upload_limit": _upload_limit, "metrics": _metrics,
    "transport": _choice("auto", "tcp", "rdma"),
    "meta": lambda v: _meta_url(v), "node_id": lambda v: _node_id(v),
    "placement": _choice("local", "hash"),
}


_FLAG_NAMES = {"placement": "--no-cache"}      # settings set by a flag of another name


def _meta_url(value: object) -> str:
    v = str(value).strip()
    if not v:
        return ""
    if not v.startswith("etcd://"):
        raise _Bad('expected "etcd://HOST:PORT[,HOST:PORT...]/NAME" (or "" for single-host)')
    from acache.meta.etcd import parse_url
    try:
        parse_url(v)
    except Exception as e:
        raise _Bad(str(e)) from None
    return v


def _node_id(value: object) -> str:
    v = str(value).strip()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", v):
        raise _Bad("a node id is 1-63 letters, digits, '.', '_' or '-'")
    return v


def _cast(key: str, value: object, where: str) -> object:
    """One setting from one source; a bad value is one line naming the source, key and value."""
    try:
        return _CASTS[key](value)
    except _Bad as e:
        raise ConfigError(f"{where}: {key} = {value!r}: {e}") from None


def _line_of(text: str, key: str) -> int:
    for i, line in enumerate(text.splitlines(), 1):
        if re.match(rf"\s*{re.escape(key)}\s*=", line) or line.strip() == f"[{key}]":
            return i
    return 0


def read_file(path: Path) -> dict:
    """Parse a TOML config file; every error names the file (and line)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path}: not a TOML text file (byte {data[e.start]:#04x} "
                          f"at offset {e.start} is not UTF-8)") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    out: dict = {}
    for key, value in raw.items():
        where = f"config file {path}, line {_line_of(text, key)}"
        out.setdefault("sources", {})[key] = where
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
    sources: dict[str, str] = values.pop("sources", {})
    for key in _CASTS:
        env = os.environ.get(f"ACACHE_{key.upper()}")
        if env not in (None, ""):
            sources[key] = f"environment ACACHE_{key.upper()}"
            values[key] = _cast(key, env, sources[key])
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
            if key in _CASTS:
                sources[key] = _FLAG_NAMES.get(key, f"--{key.replace('_', '-')}")
                values[key] = _cast(key, value, sources[key])
            else:
                values[key] = value
    s = Settings(**values, sources=sources)
    if s.cache_size is not None and s.cache_size < s.chunk_size:
        raise ConfigError(f"cache_size = {s.cache_size} ({s.source('cache_size')}) is smaller than "
                          f"chunk_size = {s.chunk_size} ({s.source('chunk_size')})")
    _check_peer_auth(s)
    if s.placement == "hash" and not s.meta:
        raise ConfigError(f"placement = hash ({s.source('placement')}) writes files into the "
                          "caches of a cluster's workers: set meta = \"etcd://HOST:PORT/NAME\" "
                          "(a node without a cache needs a cluster)")
    return replace(s, home=Path(s.home))


def _check_peer_auth(s: Settings) -> None:
    """A peer server reachable from other hosts must authenticate its peers."""
    from acache.net.auth import is_loopback
    exposed = [k for k in ("listen", "advertise") if getattr(s, k) and not is_loopback(getattr(s, k))]
    if exposed and s.secret_file is None:
        k = exposed[0]
        raise ConfigError(f"{k} = {getattr(s, k)!r} ({s.source(k)}) is not a loopback address: "
                          "set secret_file (a cluster secret, mode 600) so peers authenticate")


# -- where things live: the state dir, the cache dir, a file:// under-storage, the mount ------
def _ufs_dir(url: str) -> str | None:
    parts = urlsplit(url)
    return unquote(parts.path) if parts.scheme == "file" else None


def _inside(inner: str, outer: str) -> bool:
    return os.path.commonpath([inner, outer]) == outer


# (inner, outer): the only nestings allowed, as in the default layout <home>/cache, <home>/ufs
_NESTING_OK = {("cache directory", "state directory"), ("under-storage", "state directory")}


def check_layout(s: Settings, mountpoint: str | None = None) -> None:
    """Refuse any overlap of the state directory, the cache directory, a file:// under-storage
    and the mount point (after resolving symlinks): the same directory, or one inside another.
    The one exception is the default layout: cache and under-storage inside the state dir.
    A mount inside the under-storage would show itself; a cache inside it would be persisted;
    an under-storage inside the cache would be taken for cache files."""
    places: list[tuple[str, Path, str]] = [("state directory", s.home, s.source("home")),
              ("cache directory", s.cache_path, s.source("cache_dir") if s.cache_dir else
               "default: <state directory>/cache")]
    ufs = _ufs_dir(s.ufs_url)
    if ufs is not None:
        places.append(("under-storage", Path(ufs), s.source("ufs") if s.ufs else
                       "default: <state directory>/ufs"))
    if mountpoint is not None:
        places.append(("mount point", Path(mountpoint), "acache mount"))
    real = [(what, os.path.realpath(p), p, src) for what, p, src in places]
    for i, (a, ra, pa, sa) in enumerate(real):
        for b, rb, pb, sb in real[i + 1:]:
            if ra == rb:
                raise ConfigError(f"the {a} ({pa}, {sa}) and the {b} ({pb}, {sb}) are the same "
                                  f"directory ({ra}): they must not overlap")
            for (x, rx, px, sx), (y, ry, py, sy) in (((a, ra, pa, sa), (b, rb, pb, sb)),
                                                     ((b, rb, pb, sb), (a, ra, pa, sa))):
                if _inside(rx, ry) and (x, y) not in _NESTING_OK:
                    raise ConfigError(f"the {x} {rx} ({sx}) is inside the {y} {ry} ({sy}): "
                                      "they must not overlap")


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_devices(s: Settings) -> None:
    """``transport = rdma`` needs an RDMA device on this host: refused at start without one
    (the cheap sysfs check; pyverbs is not imported for it)."""
    if s.transport == "rdma":
        from acache.net.rdma import SYSFS, local_devices
        if not local_devices():
            raise ConfigError(f"transport = rdma ({s.source('transport')}): no RDMA device on this "
                              f"host ({SYSFS} lists none); set transport = auto or tcp")


def startup_warnings(s: Settings) -> list[str]:
    """Settings that work but probably not as meant (for the log and the terminal)."""
    out: list[str] = []
    peers = [k for k in ("listen", "advertise", "secret_file") if getattr(s, k) is not None]
    if s.transport != "auto":
        peers.append("transport")
    if peers and not s.meta:
        out.append(f"{', '.join(peers)} ({s.source(peers[0])}) set, but this node is single-host: "
                   "the peer transport starts only on a cluster member (set meta = \"etcd://...\"; "
                   "README, \"Cluster\")")
    if s.cache_size is not None:
        where = _existing(s.cache_path)
        try:
            st = os.statvfs(where)
        except OSError:
            return out
        total = st.f_blocks * st.f_frsize
        if s.cache_size > total:
            out.append(f"cache_size = {s.cache_size} ({s.source('cache_size')}) is larger than the "
                       f"whole filesystem of the cache directory {s.cache_path} ({total} bytes): "
                       "writes fail with ENOSPC when that disk is full, before the limit holds "
                       "writers back")
    return out
