"""s3:// under-storage on the minio SDK: ``s3://bucket/prefix``.

Store path ``a/b`` is the object ``<prefix>/a/b``; keys never leave the prefix.

Options (keyword arguments; each also read from ``ACACHE_S3_<NAME>``, then from
the AWS variable shown; explicit keyword > ACACHE_S3_* > AWS_*):

    endpoint       http(s)://host:port   AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL
                   (default https://s3.amazonaws.com)
    region                               AWS_REGION, AWS_DEFAULT_REGION
    access_key, secret_key, session_token
                   AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN;
                   taken together from the first layer that sets access_key
                   (none anywhere: anonymous requests)
    addressing     path | virtual | auto (default auto: virtual for AWS)
    part_size      multipart part size, bytes or "16MiB" (default 16 MiB, 5 MiB..5 GiB)
    multipart_threshold   files at least this big (or than part_size) go up as
                   multipart uploads, even in one part (default 8 MiB): see Uploads
    concurrency    parallel part uploads / copies per store (default 8)
    content_md5    auto | true | false (default auto): Content-MD5 on every upload and
                   the ETags checked (see Uploads).  auto = on where the body is not
                   otherwise verified: https (the SDK signs UNSIGNED-PAYLOAD and would
                   hash an MD5 itself, so ours costs nothing extra) and anonymous
                   requests; off over http with credentials, where the SDK signs the
                   body's SHA-256 and the server checks it (S3, MinIO, Ceph: not moto),
                   which saves hashing ~1.4 s of CPU per GiB.  false: never
    verify_tls     default true; SSL_CERT_FILE names a CA bundle
    connect_timeout, read_timeout   seconds (default 5 and 60)

Attributes, symbolic links and what listings show: see s3meta.py (s3fs-fuse's
``x-amz-meta-mode/uid/gid/mtime``; rclone's ``NAME.rclonelink``).  ``set_attrs`` is
a CopyObject of the object onto itself with the metadata replaced: no re-upload.

Directories: ``mkdir`` writes a zero-byte marker object ``<dir>/`` for the
directory and each parent (so empty directories survive, as on POSIX);
(a parent's existing marker is left as it is: it may hold attributes);
``rmdir`` deletes the marker, and fails if the directory still has entries.
Directories implied by deeper keys and markers written by other tools are
listed as directories.  A name that is both a file and a prefix lists as the
file.  Deleting a path that is a directory deletes nothing.

Uploads: a file smaller than multipart_threshold is read (and hashed) at stage()
and sent by one PutObject (Content-MD5, the returned ETag checked) at commit(); its
bytes are kept from stage() to commit() while the store's staged small files hold
less than HOLD_BYTES together (beyond that commit() reads the cache file again), so
the ordered commit, which the next waits for, reads no file.
Larger files: stage() runs CreateMultipartUpload and uploads parts in parallel
(each with Content-MD5, and its returned ETag checked against the MD5 sent);
commit() is CompleteMultipartUpload (its ETag checked: the MD5 of the parts'
MD5s, "-<count>").  Commits are taken one at a time, in order, so a
commit that carries the data (PutObject) serializes the transfers: from
multipart_threshold up, the bytes move in the parallel stage() and the ordered
commit is a short CompleteMultipartUpload.  (Against moto, whose Complete
copies the parts, a PutObject is cheaper; the 8 MiB default is the AWS CLI's.)
Progress is reported from stage(), in the caller's
thread, as parts reach the server (single PUT: once read and hashed);
an exception raised by the callback stops the stage and aborts its upload.

Tokens are ``<uuid>\\n<path>``.  ``cleanup(token)`` aborts that stage's upload
and every other multipart upload in progress on the path's key that no live
stage of this store instance owns (after a crash the upload id was never
recorded; the uploads of live stages, even of the same key, are left alone).
A cleanup that fails (S3 unreachable) raises, and its key is cleaned again at
the start of every later stage() until that works, so an outage leaves no
upload open.

Renames are CopyObject (multipart UploadPartCopy above 5 GiB) then delete; a
directory is moved object by object (in parallel), so an interrupted move is
finished by calling rename again.  A directory renamed onto a non-empty one
merges into it: S3 cannot tell that from a half-finished move.

Errors go through one table (``translate``): rejected credentials, missing or
invalid bucket, TLS failures -> PermanentError; 5xx, throttling, timeouts and
connection failures -> TransientError.  The store does not retry beyond a
couple of quick HTTP retries; short timeouts make an outage surface quickly.
"""
from __future__ import annotations

import base64
import hashlib
import os
import ssl
import stat as _stat
import threading
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

import certifi
import urllib3
from minio import Minio
from minio.commonconfig import ComposeSource, CopySource
from minio.datatypes import Part
from minio.deleteobjects import DeleteObject
from minio.error import InvalidResponseError, S3Error, ServerError
from minio.helpers import MAX_PART_SIZE, DictType, check_bucket_name

from acache.config import parse_size
from acache.data.under import s3meta
from acache.data.under.base import Attrs, UEntry, rename_needed
from acache.data.under.file import NotFoundError, clean_path, name_of, os_error
from acache.data.under.s3meta import LINK_SUFFIX, attrs_headers, parse_attrs
from acache.errors import ConfigError, PermanentError, TransientError, UnderStoreError

MiB = 1 << 20
MIN_PART = 5 * MiB
MAX_PARTS = 10_000
MAX_KEY = 1024           # bytes of an S3 key
HOLD_BYTES = 64 * MiB    # small files' bytes kept in memory from stage() to commit()

# -- the error table -------------------------------------------------------------
_HINTS = {
    "AccessDenied": "the credentials are rejected or lack permission",
    "InvalidAccessKeyId": "unknown access key: check ACACHE_S3_ACCESS_KEY / AWS_ACCESS_KEY_ID",
    "SignatureDoesNotMatch": "wrong secret key: check ACACHE_S3_SECRET_KEY / "
                             "AWS_SECRET_ACCESS_KEY",
    "NoSuchBucket": "the bucket does not exist: create it or fix the URL",
    "InvalidBucketName": "the bucket name is not valid",
    "AuthorizationHeaderMalformed": "wrong region? set ACACHE_S3_REGION",
    "PermanentRedirect": "the bucket is in another region: set ACACHE_S3_REGION",
    "RequestTimeTooSkewed": "this host's clock is wrong",
}
PERMANENT_CODES = frozenset(_HINTS) | {
    "AllAccessDisabled", "AccountProblem", "InvalidToken", "ExpiredToken",
    "InvalidRequest", "InvalidArgument", "MethodNotAllowed", "NotImplemented",
    "KeyTooLongError", "EntityTooLarge", "EntityTooSmall", "InvalidPart",
    "InvalidPartOrder", "InvalidObjectState", "MissingContentLength",
}
TRANSIENT_CODES = frozenset({
    "InternalError", "SlowDown", "ServiceUnavailable", "RequestTimeout",
    "OperationAborted", "BadDigest", "IncompleteBody", "XAmzContentSHA256Mismatch",
    "RequestTimeoutException", "Throttling", "ThrottlingException", "TooManyRequests",
    "NoSuchUpload",  # the staged upload is gone (aborted): a retry stages again
})


def classify(code: str | None, status: int) -> type[UnderStoreError]:
    """Error class for an S3 error code and HTTP status."""
    if code in PERMANENT_CODES:
        return PermanentError
    if code in TRANSIENT_CODES or status >= 500 or status in (408, 429):
        return TransientError
    return PermanentError


def translate(exc: BaseException, what: str) -> UnderStoreError | None:
    """Map a minio/urllib3/socket error to Transient/PermanentError (None: not ours).

    ``what`` names the operation, bucket/key and endpoint for the message.
    """
    if isinstance(exc, S3Error):
        status = getattr(getattr(exc, "response", None), "status", 0) or 0
        hint = _HINTS.get(exc.code or "")
        msg = f"{what}: {exc.code} (HTTP {status}): {exc.message}" + (f"; {hint}" if hint else "")
        return classify(exc.code, status)(msg)
    if isinstance(exc, ServerError):
        return classify(None, exc.status_code)(f"{what}: HTTP {exc.status_code}: {exc}")
    if isinstance(exc, InvalidResponseError):
        status = getattr(exc, "_code", 0) or 0
        return classify(None, status)(f"{what}: unexpected non-S3 answer: {exc}")
    if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason is not None:
        return translate(exc.reason, what)
    if isinstance(exc, (urllib3.exceptions.SSLError, ssl.SSLError)):
        return PermanentError(f"{what}: TLS failed: {exc}; check the endpoint's certificate "
                              "(SSL_CERT_FILE) or set verify_tls=false")
    if isinstance(exc, (urllib3.exceptions.HTTPError, OSError)):
        return TransientError(f"{what}: cannot reach the S3 endpoint: {exc}")
    if isinstance(exc, ValueError):
        return PermanentError(f"{what}: {exc}")
    return None


def _code(exc: BaseException) -> str | None:
    return exc.code if isinstance(exc, S3Error) else None


def _md5(data: bytes) -> tuple[str, str]:
    d = hashlib.md5(data, usedforsecurity=False).digest()
    return d.hex(), base64.b64encode(d).decode()


# -- options ---------------------------------------------------------------------
_AWS_ENV = {
    "endpoint": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
    "region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
    "access_key": ("AWS_ACCESS_KEY_ID",),
    "secret_key": ("AWS_SECRET_ACCESS_KEY",),
    "session_token": ("AWS_SESSION_TOKEN",),
}
_DEFAULTS: dict[str, Any] = {
    "endpoint": "https://s3.amazonaws.com", "region": None, "addressing": "auto",
    "part_size": 16 * MiB, "multipart_threshold": 8 * MiB, "concurrency": 8,
    "content_md5": "auto", "verify_tls": True,
    "connect_timeout": 5.0, "read_timeout": 60.0,
}
_CREDS = ("access_key", "secret_key", "session_token")


def resolve_options(kwargs: dict, env=None) -> dict:
    """Merge options: explicit kwargs > ACACHE_S3_* > AWS_* > defaults."""
    env = os.environ if env is None else env
    unknown = set(kwargs) - set(_DEFAULTS) - set(_CREDS)
    if unknown:
        raise ConfigError(f"unknown s3:// options: {', '.join(sorted(unknown))}")
    layers = [
        {k: v for k, v in kwargs.items() if v is not None},
        {k: env[f"ACACHE_S3_{k.upper()}"] for k in [*_DEFAULTS, *_CREDS]
         if env.get(f"ACACHE_S3_{k.upper()}")},
        {k: next(env[n] for n in names if env.get(n))
         for k, names in _AWS_ENV.items() if any(env.get(n) for n in names)},
    ]
    out = dict(_DEFAULTS)
    for k in _DEFAULTS:
        out[k] = next((layer[k] for layer in layers if k in layer), out[k])
    creds = next((layer for layer in layers if "access_key" in layer), {})
    for k in _CREDS:
        out[k] = creds.get(k)
    try:
        out["part_size"] = parse_size(out["part_size"], "s3:// part_size")
        out["multipart_threshold"] = parse_size(out["multipart_threshold"],
                                                "s3:// multipart_threshold")
        out["concurrency"] = int(out["concurrency"])
        out["connect_timeout"] = float(out["connect_timeout"])
        out["read_timeout"] = float(out["read_timeout"])
    except (TypeError, ValueError) as e:
        raise ConfigError(f"bad s3:// option value: {e}") from e
    for k in ("verify_tls", "content_md5"):
        if isinstance(out[k], str):
            v = out[k].strip().lower()
            out[k] = "auto" if k == "content_md5" and v == "auto" else v not in ("0", "false", "no", "off")
    if not MIN_PART <= out["part_size"] <= MAX_PART_SIZE:
        raise ConfigError(f"s3:// part_size must be 5 MiB..5 GiB, got {out['part_size']}")
    if out["multipart_threshold"] > MAX_PART_SIZE:
        raise ConfigError("s3:// multipart_threshold must be at most 5 GiB (a PutObject)")
    if out["concurrency"] < 1:
        raise ConfigError("s3:// concurrency must be >= 1")
    if out["addressing"] not in ("path", "virtual", "auto"):
        raise ConfigError(f"s3:// addressing must be path, virtual or auto, "
                          f"got {out['addressing']!r}")
    if out["access_key"] and not out["secret_key"]:
        raise ConfigError("s3:// access_key is set but secret_key is not")
    return out


class _Wire:
    """The minio calls without a public form (minio 7.2 private API), in one place."""

    def __init__(self, client: Minio, bucket: str):
        self.c, self.b = client, bucket

    def put(self, key: str, data: bytes, md5_b64: str | None, meta: dict | None = None) -> str:
        headers = {"Content-Type": "application/octet-stream", **(meta or {})}
        if md5_b64:
            headers["Content-MD5"] = md5_b64
        res = self.c._put_object(self.b, key, data, headers)
        return res.etag or ""

    def create_upload(self, key: str, meta: dict | None = None) -> str:
        return self.c._create_multipart_upload(
            self.b, key, {"Content-Type": "application/octet-stream", **(meta or {})})

    def upload_part(self, key: str, upload_id: str, number: int, data: bytes,
                    md5_b64: str | None) -> str:
        headers: DictType = {"Content-MD5": md5_b64} if md5_b64 else {}
        etag = self.c._upload_part(self.b, key, data, headers, upload_id, number)
        return (etag or "").strip('"')

    def complete(self, key: str, upload_id: str, parts: list[tuple[int, str]]) -> str:
        res = self.c._complete_multipart_upload(
            self.b, key, upload_id, [Part(n, e) for n, e in parts])
        if not res.etag:  # S3 may answer 200 with an <Error> body
            raise TransientError(f"CompleteMultipartUpload of {key!r} returned no ETag")
        return res.etag.strip('"')

    def abort(self, key: str, upload_id: str) -> None:
        try:
            self.c._abort_multipart_upload(self.b, key, upload_id)
        except S3Error as e:
            if e.code != "NoSuchUpload":
                raise

    def uploads(self, key: str) -> tuple[list[tuple[str, str]], bool]:
        """(key, upload id) of in-progress uploads whose key starts with ``key``."""
        res = self.c._list_multipart_uploads(self.b, prefix=key, max_uploads=1000)
        return [(u.object_name, u.upload_id) for u in res.uploads
                if u.upload_id is not None], res.is_truncated   # (S3 always sends one)

    def first_under(self, prefix: str, n: int = 1) -> list:
        """At most ``n`` entries (one level) under ``prefix``: a cheap 'is there any'."""
        it = self.c._list_objects(self.b, prefix=prefix, delimiter="/", max_keys=n,
                                  encoding_type="url")
        return [o for _, o in zip(range(n), it)]


class S3Store:
    atomic_dir_rename = False   # a prefix moves object by object

    def __init__(self, url: str, **options):
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
            raise ConfigError(f"bad s3:// URL {url!r}: expected s3://bucket/prefix")
        self.url = url
        self.bucket = parts.netloc
        try:
            check_bucket_name(self.bucket)
        except ValueError as e:
            raise ConfigError(f"bad s3:// URL {url!r}: {e}") from e
        prefix = parts.path.strip("/")
        try:
            clean_path(prefix, "prefix")
        except PermanentError as e:
            raise ConfigError(f"bad s3:// URL {url!r}: {e}") from e
        self.prefix = prefix + "/" if prefix else ""
        o = resolve_options(options)
        self.part_size, self.concurrency = o["part_size"], o["concurrency"]
        self.multipart_threshold = max(1, min(o["multipart_threshold"], self.part_size))
        ep = urlsplit(o["endpoint"] if "://" in o["endpoint"] else "https://" + o["endpoint"])
        if ep.scheme not in ("http", "https") or not ep.netloc or ep.path not in ("", "/"):
            raise ConfigError(f"bad s3:// endpoint {o['endpoint']!r}: expected http(s)://host:port")
        self.content_md5 = o["content_md5"]
        if self.content_md5 == "auto":   # off only where the server checks a signed SHA-256
            self.content_md5 = ep.scheme == "https" or not o["access_key"]
        self.endpoint = f"{ep.scheme}://{ep.netloc}"
        self._http = http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=o["connect_timeout"], read=o["read_timeout"]),
            maxsize=self.concurrency + 4,
            cert_reqs="CERT_REQUIRED" if o["verify_tls"] else "CERT_NONE",
            ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
            # a couple of quick retries of refused connections and 5xx answers; none
            # after a read timeout, which already took read_timeout
            retries=urllib3.Retry(total=2, read=0, backoff_factor=0.2, raise_on_status=False,
                                  status_forcelist=[500, 502, 503, 504]))
        try:
            self.client = Minio(ep.netloc, access_key=o["access_key"], secret_key=o["secret_key"],
                                session_token=o["session_token"], secure=ep.scheme == "https",
                                region=o["region"], http_client=http)
        except ValueError as e:
            raise ConfigError(f"bad s3:// options for {url!r}: {e}") from e
        if o["addressing"] == "path":
            self.client.disable_virtual_style_endpoint()
        elif o["addressing"] == "virtual":
            self.client.enable_virtual_style_endpoint()
        self.wire = _Wire(self.client, self.bucket)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._inflight: dict[str, tuple[str, str | None]] = {}
        # (key, upload id or None) whose cleanup failed: retried before the next stage
        self._unclean: set[tuple[str, str | None]] = set()
        # Only this node writes under the prefix (one host: the embedded metadata).  Then
        # a token with no upload id (a crash between CreateMultipartUpload and recording its
        # id) is cleaned by listing the uploads on its key.  A cluster shares the prefix and
        # sets this False: another node's live upload may be on the same key, so only
        # recorded ids are aborted (an unrecorded one is left to a lifecycle rule).
        self.exclusive = True
        self._take: Callable[[int], None] | None = None    # the bandwidth limit
        self.hold_limit = HOLD_BYTES     # staged small files' bytes kept for commit()
        self._held = 0                   # bytes kept now (under _lock)

    # -- helpers -------------------------------------------------------------
    def _key(self, path: str) -> str:
        key = self.prefix + clean_path(path)
        if len(key.encode("utf-8", "surrogateescape")) + len(LINK_SUFFIX) + 1 > MAX_KEY:
            raise PermanentError(f"s3://{self.bucket}: the path {path!r} is too long for an S3 "
                                 f"key ({MAX_KEY} bytes with the prefix)")
        return key

    def _dirkey(self, path: str) -> str:
        return self._key(path) + "/" if path else self.prefix

    @contextmanager
    def _errors(self, op: str, key: str = ""):
        try:
            yield
        except UnderStoreError:
            raise
        except Exception as e:
            err = translate(e, f"s3 {op} s3://{self.bucket}/{key} at {self.endpoint}")
            if err is None:
                raise
            raise err from e

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="acache-s3")
            return self._pool

    def _run_all(self, fn, items, on_done=None) -> list:
        """Run fn(item) for every item on the pool; the first error cancels the rest."""
        futs = [self._executor().submit(fn, it) for it in items]
        results, pending = [], set(futs)
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for f in done:
                    results.append(f.result())
                    if on_done is not None:
                        on_done(results[-1])
        finally:
            if pending:
                for f in pending:
                    f.cancel()
                wait(pending)
        return results

    def _head(self, key: str):
        try:
            return self.client.stat_object(self.bucket, key)
        except S3Error as e:
            if e.code in ("NoSuchKey", "NotFound", "NoSuchObject"):
                return None
            raise

    def _exists(self, path: str) -> bool:
        return self._head(self._key(path)) is not None or \
            self._head(self._key(path) + LINK_SUFFIX) is not None or \
            bool(self.wire.first_under(self._dirkey(path)))

    # -- UnderStore ----------------------------------------------------------
    def check(self) -> None:
        with self._errors("check", self.prefix):
            # A GET (not HEAD, whose errors have no body) so that the server says why:
            # NoSuchBucket, InvalidAccessKeyId, SignatureDoesNotMatch...
            self.wire.first_under(self.prefix)
            # A write probe that leaves no object: start and abort a multipart upload.
            probe = self.prefix + ".acache-check"
            self.wire.abort(probe, self.wire.create_upload(probe))

    def list_dir(self, path: str) -> Iterator[UEntry]:
        return self._list(self._dirkey(path))

    def _list(self, prefix: str) -> Iterator[UEntry]:
        with self._errors("list", prefix):
            return iter(s3meta.list_entries(self, prefix))

    def stat(self, path: str) -> UEntry | None:
        if not path:
            return UEntry("", True)
        key = self._key(path)
        with self._errors("stat", key):
            o = self._head(key)
            if o is not None:
                mtime = o.last_modified.timestamp() if o.last_modified else 0.0
                return UEntry(name_of(path), False, o.size or 0, mtime, **parse_attrs(o.metadata))
            target, headers = s3meta.get_small(self, key + LINK_SUFFIX)
            if target:
                return UEntry(name_of(path), False, len(target), 0.0, **parse_attrs(headers),
                              link=target.decode("utf-8", "surrogateescape"))
            if self.wire.first_under(key + "/"):
                m = self._head(key + "/")
                return UEntry(name_of(path), True, **parse_attrs(m.metadata if m else None))
        return None

    def read(self, path: str, offset: int, length: int) -> bytes:
        key = self._key(path)
        if length <= 0:
            return b""
        with self._errors("read", key):
            try:
                resp = self.client.get_object(self.bucket, key, offset=offset, length=length)
            except S3Error as e:
                if e.code in ("NoSuchKey", "NotFound"):
                    raise NotFoundError(f"s3 read s3://{self.bucket}/{key} at {self.endpoint}: "
                                        "no such object") from None
                if e.code == "InvalidRange":
                    return b""
                raise
            try:
                return resp.read()[:length]
            finally:
                resp.close()
                resp.release_conn()

    def new_token(self, path: str) -> str:
        clean_path(path)
        return f"{uuid.uuid4().hex}\n{path}"

    @staticmethod
    def _token_parts(token: str) -> tuple[str, str | None]:
        """(path, upload id or None) of a token ``<uuid>[ <upload id>]\n<path>``: the id is
        added (``on_token``) once CreateMultipartUpload gave it, so cleanup aborts exactly
        that upload (S3 upload ids hold no space or newline)."""
        head, sep, path = token.partition("\n")
        tid, _, upload_id = head.partition(" ")
        if not sep or not tid:
            raise PermanentError(f"not an s3:// stage token: {token!r}")
        return clean_path(path, "token path"), upload_id or None

    def _token_path(self, token: str) -> str:
        return self._token_parts(token)[0]

    def local_stage(self, size: int) -> bool:
        """A small file's stage reads and hashes it, and sends it at commit(); unless a
        failed cleanup is pending, which the next stage() retries first."""
        return size < self.multipart_threshold and not self._unclean

    def stage(self, path: str, token: str, src_path: str, size: int,
              progress: Callable[[int], None] | None = None,
              attrs: Attrs | None = None,
              on_token: Callable[[str], None] | None = None) -> "S3Staged":
        key = self._begin_stage(path, token)
        if size < self.multipart_threshold:
            data = _read_source(src_path, size, f"s3 stage {key}")
            staged = S3Staged(self, token, key, size, src_path=src_path,
                              md5=_md5(data) if self.content_md5 else None,
                              meta=attrs_headers(attrs, _stat.S_IFREG),
                              data=data if self._hold(size) else None)
            if progress is not None:
                try:
                    progress(size)  # read and hashed; sent by commit()
                except BaseException:
                    staged.abort()   # gives back what it holds
                    raise
            return staged
        with self._errors("stage", key):
            return self._stage_multipart(token, key, src_path, size, progress,
                                         attrs_headers(attrs, _stat.S_IFREG), on_token)

    def _begin_stage(self, path: str, token: str) -> str:
        """What every stage checks and retries first; the key it stages onto."""
        key = self._key(path)
        if not path:
            raise PermanentError("cannot stage onto the root directory")
        self._token_path(token)
        if self._unclean:
            try:
                self._retry_cleanups()
            except UnderStoreError:
                pass  # still unreachable: kept for the next stage; this one says why
        return key

    def _part_size_for(self, size: int) -> int:
        ps = self.part_size
        if -(-size // ps) > MAX_PARTS:
            ps = -(-size // MAX_PARTS)
            ps = -(-ps // MiB) * MiB
        return ps

    # -- a multipart stage whose parts another node sends (a cluster's head staging a file
    # that a member holds: the member uploads each part from its own cache, the head
    # creates, records and completes the upload, in order; no byte crosses the head)
    def parts_elsewhere(self, size: int) -> bool:
        """Would a stage of ``size`` bytes go up in parts (stage_parts can do it)?"""
        return size >= self.multipart_threshold

    def stage_parts(self, path: str, token: str, size: int,
                    send_part: Callable[[str, int, int, int], str],
                    progress: Callable[[int], None] | None = None,
                    attrs: Attrs | None = None,
                    on_token: Callable[[str], None] | None = None) -> "S3Staged":
        """stage() of a file this node does not hold: ``send_part(upload_id, number,
        offset, length)`` has part ``number`` (bytes [offset, offset+length) of the file)
        uploaded elsewhere (upload_part_from on the holder) and returns its ETag."""
        key = self._begin_stage(path, token)
        with self._errors("stage", key):
            return self._stage_multipart(token, key, None, size, progress,
                                         attrs_headers(attrs, _stat.S_IFREG), on_token,
                                         send_part=send_part)

    def upload_part_from(self, path: str, upload_id: str, fd: int, number: int, offset: int,
                         length: int) -> str:
        """Upload part ``number`` of the multipart upload ``upload_id`` on ``path``'s key:
        bytes [offset, offset+length) of ``fd`` (the holder's side of stage_parts)."""
        if not (1 <= number <= MAX_PARTS and 0 <= offset and 0 < length <= MAX_PART_SIZE
                and upload_id and path):
            raise PermanentError(f"bad part request: part {number}, {length} bytes at {offset}")
        return self._upload_part(self._key(path), upload_id, fd, number, offset, length)[1]

    def _stage_multipart(self, token, key, src_path, size, progress, meta,
                         on_token=None, send_part=None) -> "S3Staged":
        ps = self._part_size_for(size)
        ranges = [(i + 1, off, min(ps, size - off)) for i, off in enumerate(range(0, size, ps))]
        fd = -1
        if send_part is None:
            try:
                fd = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise os_error(e, f"s3 stage {key}: reading the source") from e
        upload_id = None
        self._track(token, key, None)
        try:
            upload_id = self.wire.create_upload(key, meta)
            self._track(token, key, upload_id)
            if on_token is not None:    # recorded before any part: cleanup finds exactly it
                head, _, path = token.partition("\n")
                new = f"{head.partition(' ')[0]} {upload_id}\n{path}"
                self._track(new, key, upload_id)
                self._untrack(token)
                token = new
                on_token(new)

            def one(r):
                if send_part is not None:
                    return r[0], send_part(upload_id, *r), r[2]
                return self._upload_part(key, upload_id, fd, *r)
            parts = self._run_all(one, ranges, (lambda p: progress(p[2])) if progress else None)
        except BaseException:
            self._untrack(token)
            if upload_id is not None:
                try:
                    self.wire.abort(key, upload_id)
                except Exception:
                    pass  # cleanup(token) finds it later
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        parts.sort()
        return S3Staged(self, token, key, size, upload_id=upload_id,
                        parts=[(n, etag) for n, etag, _ in parts])

    def _upload_part(self, key, upload_id, fd, number, off, length) -> tuple[int, str, int]:
        chunks, got = [], 0
        try:
            while got < length:
                buf = os.pread(fd, length - got, off + got)
                if not buf:
                    raise PermanentError(f"source file ended at {off + got} bytes, "
                                         f"expected more for part {number}")
                chunks.append(buf)
                got += len(buf)
        except OSError as e:
            raise os_error(e, f"s3 stage {key}: reading the source") from e
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        md5_hex, md5_b64 = _md5(data) if self.content_md5 else (None, None)
        if self._take is not None:
            self._take(length)
        with self._errors(f"upload part {number} of", key):
            etag = self.wire.upload_part(key, upload_id, number, data, md5_b64)
        if md5_hex is not None and etag.lower() != md5_hex:
            raise PermanentError(
                f"part {number} of s3://{self.bucket}/{key}: the server's ETag {etag} is "
                f"not the MD5 {md5_hex} of the bytes sent (server-side encryption "
                "with KMS is not supported)")
        return number, etag, length

    def _hold(self, size: int) -> bool:
        """May a staged small file keep ``size`` bytes in memory until its commit?"""
        with self._lock:
            if self._held + size > self.hold_limit:
                return False
            self._held += size
            return True

    # In-flight multipart stages of this instance: token -> (key, upload id or None
    # while CreateMultipartUpload is under way).  cleanup() never aborts these.
    def _track(self, token: str, key: str, upload_id: str | None) -> None:
        with self._lock:
            self._inflight[token] = (key, upload_id)

    def _untrack(self, token: str) -> None:
        with self._lock:
            self._inflight.pop(token, None)

    def cleanup(self, token: str) -> None:
        """Abort this token's multipart upload: the one its token records (``on_token``)
        or this instance is running for it.  A token with no upload id: when the prefix
        is ours alone (``exclusive``), every upload on its key that no live stage of this
        instance owns (a crashed stage's); otherwise nothing (it cannot be told from
        another node's).  If that fails (S3 unreachable), it is retried before the next
        stage."""
        path, recorded = self._token_parts(token)
        key = self._key(path)
        with self._lock:
            own = self._inflight.pop(token, (key, None))[1] or recorded
        try:
            with self._errors("cleanup", key):
                self._clean(key, own)
        except UnderStoreError:
            with self._lock:
                self._unclean.add((key, own))
            raise

    def _clean(self, key: str, upload_id: str | None) -> bool:
        """Abort ``upload_id`` on ``key`` (if any), then, without one and on an exclusive
        prefix, the uploads on the key no live stage owns; False if that could not tell."""
        if upload_id is not None:
            self.wire.abort(key, upload_id)
            return True
        return self._abort_stale(key) if self.exclusive else True

    def _abort_stale(self, key: str) -> bool:
        """Abort the uploads on ``key`` that no live stage owns; False if it cannot tell."""
        with self._lock:
            live = {u for k, u in self._inflight.values() if k == key}
        if None in live:
            return False  # another stage of this key is creating its upload: can't tell apart
        while True:
            uploads, truncated = self.wire.uploads(key)
            mine = [u for k, u in uploads if k == key]
            stale = [u for u in mine if u not in live]
            for upload_id in stale:
                self.wire.abort(key, upload_id)
            # this key's uploads sort first; a full page of them means: list again
            if not (truncated and stale and len(mine) == len(uploads)):
                return True

    def _retry_cleanups(self) -> None:
        """Clean the keys whose cleanup failed earlier (raises while that fails)."""
        with self._lock:
            pending = list(self._unclean)
        for key, upload_id in pending:
            with self._errors("cleanup", key):
                done = self._clean(key, upload_id)
            if done:
                with self._lock:
                    self._unclean.discard((key, upload_id))

    def rename(self, src: str, dst: str) -> None:
        sk, dk = self._key(src), self._key(dst)
        if not rename_needed(src, dst):
            return
        with self._errors("rename", f"{sk} -> {dk}"):
            for suffix, other in (("", LINK_SUFFIX), (LINK_SUFFIX, "")):   # a file, or a link
                o = self._head(sk + suffix)
                if o is not None:   # it replaces a file or a link at dst: same request count
                    self._copy(sk + suffix, dk + suffix, o.size or 0)
                    self._delete_many([sk + suffix, dk + other])
                    return
            if self._move_prefix(sk + "/", dk + "/"):
                return
            if self._exists(dst):
                return  # done before (a retry after a crash)
            raise PermanentError(f"s3 rename s3://{self.bucket}/{sk} -> {dk}: neither exists")

    def _copy(self, sk: str, dk: str, size: int) -> None:
        if size > MAX_PART_SIZE:  # multipart copy (UploadPartCopy ranges)
            self.client.compose_object(self.bucket, dk, [ComposeSource(self.bucket, sk)])
        else:
            self.client.copy_object(self.bucket, dk, CopySource(self.bucket, sk))

    def _move_prefix(self, sp: str, dp: str) -> bool:
        """Copy every object under sp to dp, then delete them; False if there were none.

        Interrupted midway, a second call finishes the job: what was moved is
        no longer under sp.
        """
        objs = [(o.object_name, o.size or 0) for o in
                self.client.list_objects(self.bucket, prefix=sp, recursive=True)]
        if not objs:
            return False

        def copy(obj):
            with self._errors("rename copy", obj[0]):
                self._copy(obj[0], dp + obj[0][len(sp):], obj[1])
        self._run_all(copy, objs)
        self._delete_many([k for k, _ in objs])
        return True

    def _delete_many(self, keys: list[str]) -> None:
        errors = list(self.client.remove_objects(self.bucket, [DeleteObject(k) for k in keys]))
        errors = [e for e in errors if e.code not in ("NoSuchKey",)]
        if errors:
            e = errors[0]
            raise classify(e.code, 0)(
                f"s3 delete s3://{self.bucket}/{e.name} at {self.endpoint}: {e.code}: "
                f"{e.message} ({len(errors)} of {len(keys)} deletes failed)")

    def delete(self, path: str) -> None:
        key = self._key(path)
        if not path:
            raise PermanentError("cannot delete the root directory")
        with self._errors("delete", key):   # a file or a link: one DeleteObjects request
            self._delete_many([key, key + LINK_SUFFIX])

    def mkdir(self, path: str, attrs: Attrs | None = None) -> None:
        clean_path(path)
        parts = path.split("/") if path else []
        empty_b64 = _md5(b"")[1]
        for i in range(1, len(parts) + 1):
            key = self._key("/".join(parts[:i])) + "/"
            with self._errors("mkdir", key):
                if i < len(parts) and self._head(key) is not None:
                    continue     # a parent's marker may hold its attributes: keep it
                self.wire.put(key, b"", empty_b64,
                              attrs_headers(attrs, _stat.S_IFDIR) if i == len(parts) else None)

    def symlink(self, path: str, target: str, attrs: Attrs | None = None) -> None:
        key = self._key(path)
        if not path or not target or "\0" in target:
            raise PermanentError(f"s3 symlink {path!r} -> {target!r}: invalid")
        body = target.encode("utf-8", "surrogateescape")
        with self._errors("symlink", key + LINK_SUFFIX):
            self.wire.put(key + LINK_SUFFIX, body, _md5(body)[1],
                          attrs_headers(attrs, _stat.S_IFLNK))
            self._delete_many([key])     # it replaces a file there (rare: links are few)

    def set_attrs(self, path: str, attrs: Attrs) -> None:
        if path:   # the root's attributes belong to the operator
            s3meta.set_attrs(self, path, attrs)

    def rmdir(self, path: str) -> None:
        dk = self._dirkey(path)
        if not path:
            raise PermanentError("cannot remove the root directory")
        with self._errors("rmdir", dk):
            if any(o.object_name != dk for o in self.wire.first_under(dk, 2)):
                raise PermanentError(f"s3 rmdir s3://{self.bucket}/{dk}: directory not empty")
            self.client.remove_object(self.bucket, dk)

    def set_limiter(self, take: Callable[[int], None] | None) -> None:
        self._take = take

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._http.clear()

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self.endpoint!r})"


def _read_source(path: str, size: int, what: str, commit: bool = False) -> bytes:
    """The bytes of a cache file; at commit, a file gone or changed since stage() is
    transient (the persister stages again, and stage() says what is wrong)."""
    try:
        with open(path, "rb") as f:
            data = f.read(size)
    except OSError as e:
        if commit:
            raise TransientError(f"{what}: reading the staged cache file: {e}") from e
        raise os_error(e, f"{what}: reading the source") from e
    if len(data) != size:
        raise (TransientError if commit else PermanentError)(
            f"{what}: source file ended at {len(data)} bytes, expected {size}")
    return data


class S3Staged:
    """Staged bytes: a small file read and hashed (its bytes kept for the PutObject
    while the store's HOLD_BYTES allow, else read again from the cache file by
    commit(): the cache file of a pending PUT does not change), or a multipart
    upload with every part sent and checked.
    commit() checks the object's ETag: the MD5 of the bytes (PutObject), or the
    MD5 of the parts' MD5s and their count."""

    def __init__(self, store: S3Store, token: str, key: str, size: int, *,
                 src_path: str | None = None, md5: tuple[str, str] | None = None,
                 upload_id: str | None = None, parts: list[tuple[int, str]] | None = None,
                 meta: dict | None = None, data: bytes | None = None):
        self.token = token
        self.key = key
        self.size = size
        self.upload_id = upload_id
        self._store = store
        self._src = src_path
        self._md5_hex: str | None
        self._md5: str | None
        self._md5_hex, self._md5 = md5 or (None, None)
        self._parts = parts or []
        self._meta = meta or {}
        self._done = False
        self._aborted = False
        self._data = data        # held in the store's HOLD_BYTES until commit or abort

    def _drop_data(self) -> None:
        s = self._store
        with s._lock:       # once, whoever gets here first (commit, abort)
            if self._data is not None:
                self._data = None
                s._held -= self.size

    def _multipart_etag(self) -> str:
        digest = hashlib.md5(b"".join(bytes.fromhex(e) for _, e in self._parts),
                             usedforsecurity=False)
        return f"{digest.hexdigest()}-{len(self._parts)}"

    def commit(self) -> None:
        if self._done:
            return
        s = self._store
        with s._errors("commit", self.key):
            if self.upload_id is None:
                if self._aborted:
                    raise PermanentError(f"commit of s3://{s.bucket}/{self.key} after abort")
                data = self._data
                if data is None:   # (changed since stage(): the server rejects the
                    src = self._src    # Content-MD5, BadDigest)
                    assert src is not None, "a single-PUT stage has its cache file"
                    data = _read_source(src, self.size,
                                        f"s3 commit {self.key}", commit=True)
                if s._take is not None:
                    s._take(len(data))
                try:
                    etag, want = s.wire.put(self.key, data, self._md5, self._meta), self._md5_hex
                finally:   # sent or failed: a retry reads the cache file (the persister
                    self._drop_data()    # stages a failed entry again anyway)
            else:
                want = self._multipart_etag()   # from the parts' ETags
                try:
                    etag = s.wire.complete(self.key, self.upload_id, self._parts)
                except S3Error as e:
                    # NoSuchUpload after a lost reply: done if the object is ours
                    o = s._head(self.key) if e.code == "NoSuchUpload" else None
                    if o is None or (o.etag or "").strip('"') != want:
                        raise
                    etag = want
            if s.content_md5 and etag.strip('"').lower() != want:
                raise PermanentError(
                    f"commit of s3://{s.bucket}/{self.key}: the server's ETag {etag} is not "
                    f"{want}, the MD5 of the bytes sent (server-side encryption with KMS is "
                    "not supported)")
        self._done = True
        s._untrack(self.token)

    def abort(self) -> None:
        s = self._store
        self._aborted = True
        self._drop_data()
        if self.upload_id is not None and not self._done:
            with s._errors("abort", self.key):
                s.wire.abort(self.key, self.upload_id)
        s._untrack(self.token)
