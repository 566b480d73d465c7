"""What an S3 store keeps besides bytes: attributes, symbolic links, listings that show both.

Attributes are user metadata in s3fs-fuse's convention, which rclone also reads:

    x-amz-meta-mode   the whole st_mode in decimal (type bits included: 33188 = 0100644)
    x-amz-meta-uid    decimal
    x-amz-meta-gid    decimal
    x-amz-meta-mtime  seconds since the epoch with the nanoseconds as a fraction
                      ("1700000000.123456789"; plain integer seconds are read too)

An object written by another tool without them lists with "unknown" (0 / -1) and the
VFS shows its defaults.  Directories keep theirs on the ``dir/`` marker object.

A symbolic link is the object ``NAME.rclonelink`` whose body is the target: rclone's
``--links`` convention.  A listing shows it by name alone (no request per object to
find out which entries are links), rclone users see the same links, and the target
is data like any other.  The price: a file whose own name ends in ``.rclonelink``
lists as a link (as it does for rclone).

S3 listings carry no user metadata, so listing a directory asks for it: a HEAD per
file and directory marker, a GET per link (the target), in parallel on a bounded
pool (the store's concurrency + 4: the size of its HTTP connection pool).  It costs
one request per entry, once per directory per cache: see docs/benchmarks.md for a figure.

Keys that cannot be names in a mount ('.', '..' or empty segments, a segment over
255 bytes, a NUL) are skipped with a warning, never mapped outside the prefix.
"""
from __future__ import annotations

import base64
import hashlib
import logging
import stat as _stat
from concurrent.futures import ThreadPoolExecutor

from minio.commonconfig import REPLACE, CopySource
from minio.error import S3Error

from acache.data.under.base import Attrs, UEntry, bad_name

log = logging.getLogger("acache.under.s3")
LINK_SUFFIX = ".rclonelink"
LIST_WORKERS = 32
_META = "x-amz-meta-"
EMPTY_MD5 = base64.b64encode(hashlib.md5(b"", usedforsecurity=False).digest()).decode()


def attrs_headers(attrs: Attrs | None, kind: int) -> dict[str, str]:
    """The metadata headers for ``attrs`` (``kind``: S_IFREG, S_IFDIR or S_IFLNK)."""
    h: dict[str, str] = {}
    if attrs is None:
        return h
    if attrs.mode:
        h[_META + "mode"] = str(kind | (attrs.mode & 0o7777))
    if attrs.uid >= 0:
        h[_META + "uid"] = str(attrs.uid)
    if attrs.gid >= 0:
        h[_META + "gid"] = str(attrs.gid)
    if attrs.mtime_ns:
        sec, ns = divmod(attrs.mtime_ns, 1_000_000_000)
        h[_META + "mtime"] = f"{sec}.{ns:09d}"
    return h


def _int(v) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _mtime_ns(v) -> int:
    if not v:
        return 0
    sec, _, frac = str(v).strip().partition(".")
    s = _int(sec)
    f = _int((frac + "000000000")[:9]) if frac else 0
    if s is None or f is None or s < 0:
        return 0
    return s * 1_000_000_000 + f


def parse_attrs(headers) -> dict:
    """UEntry keyword arguments from a HEAD/GET answer's headers (unknown: 0 / -1)."""
    if headers is None:
        return {}
    mode, uid, gid = (_int(headers.get(_META + k)) for k in ("mode", "uid", "gid"))
    return dict(mode=_stat.S_IMODE(mode) if mode and mode > 0 else 0,
                uid=uid if uid is not None and uid >= 0 else -1,
                gid=gid if gid is not None and gid >= 0 else -1,
                mtime_ns=_mtime_ns(headers.get(_META + "mtime")))


def user_metadata(headers) -> dict[str, str]:
    """The x-amz-meta-* headers of an object (kept when its attributes change)."""
    return {k.lower(): v for k, v in (headers or {}).items() if k.lower().startswith(_META)}


def _when(o) -> float:
    return o.last_modified.timestamp() if getattr(o, "last_modified", None) else 0.0


def list_entries(store, prefix: str) -> list[UEntry]:
    """One level under the key prefix ``prefix``, with attributes and link targets."""
    files: dict[str, object] = {}
    links: dict[str, object] = {}
    dirs: set[str] = set()
    for o in store.client.list_objects(store.bucket, prefix=prefix or None):
        name = o.object_name[len(prefix):]
        if o.is_dir:
            name = name[:-1]
        elif not name:
            continue   # the directory's own marker
        is_link = not o.is_dir and name.endswith(LINK_SUFFIX) and len(name) > len(LINK_SUFFIX)
        if is_link:
            name = name[:-len(LINK_SUFFIX)]
        why = bad_name(name)
        if why is not None:
            log.warning("s3://%s/%s: skipping %r: %s", store.bucket, o.object_name, name, why)
            continue
        if o.is_dir:
            dirs.add(name)
        elif is_link:
            links[name] = o
        else:
            files[name] = o
    for name in set(links) & set(files):
        log.warning("s3://%s/%s%s: both a file and a link: listing the file", store.bucket,
                    prefix, name)
        del links[name]
    dirs -= set(files) | set(links)    # a name that is both a file and a prefix: the file

    def fetch(item):
        name, kind, o = item
        if kind == "dir":
            h = store._head(prefix + name + "/")
            return UEntry(name, True, 0, _when(h) if h else 0.0,
                          **parse_attrs(h.metadata if h else None))
        if kind == "link":
            target, headers = get_small(store, o.object_name)
            if target is None:
                return None        # deleted since the listing
            t = target.decode("utf-8", "surrogateescape")
            if not t or "\0" in t:
                log.warning("s3://%s/%s: skipping a link with an empty or invalid target",
                            store.bucket, o.object_name)
                return None
            return UEntry(name, False, len(target), _when(o), **parse_attrs(headers), link=t)
        h = store._head(o.object_name)
        return UEntry(name, False, o.size or 0, _when(o), **parse_attrs(h.metadata if h else None))

    items = [(n, "dir", None) for n in dirs] + [(n, "link", o) for n, o in links.items()] + \
        [(n, "file", o) for n, o in files.items()]
    if not items:
        return []
    workers = min(LIST_WORKERS, store.concurrency + 4, len(items))   # the HTTP pool's size
    with ThreadPoolExecutor(workers, thread_name_prefix="acache-s3ls") as ex:
        out = [e for e in ex.map(fetch, items) if e is not None]
    out.sort(key=lambda u: u.name)
    return out


def get_small(store, key: str):
    """(body, headers) of a small object (a link), or (None, None) if it is gone."""
    try:
        resp = store.client.get_object(store.bucket, key)
    except S3Error as e:
        if e.code in ("NoSuchKey", "NotFound"):
            return None, None
        raise
    try:
        return resp.read(), resp.headers
    finally:
        resp.close()
        resp.release_conn()


def set_attrs(store, path: str, attrs: Attrs) -> None:
    """CopyObject onto itself with the metadata replaced (other x-amz-meta-* kept): no
    re-upload.  A directory's marker is written again (made, for one without a marker)."""
    key = store._key(path)
    with store._errors("set_attrs", key):
        for k, kind in ((key, _stat.S_IFREG), (key + LINK_SUFFIX, _stat.S_IFLNK)):
            o = store._head(k)
            if o is not None:
                meta = {**user_metadata(o.metadata), **attrs_headers(attrs, kind),
                        "Content-Type": o.content_type or "application/octet-stream"}
                store.client.copy_object(store.bucket, k, CopySource(store.bucket, k),
                                         metadata=meta, metadata_directive=REPLACE)
                return
        if store._head(key + "/") is not None or store.wire.first_under(key + "/"):
            store.wire.put(key + "/", b"", EMPTY_MD5, attrs_headers(attrs, _stat.S_IFDIR))
            return
    log.info("s3://%s/%s is gone: its attributes cannot be set", store.bucket, key)
