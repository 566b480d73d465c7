"""The UnderStore conformance suite: the same tests against file://, mem:// and s3://
(a moto server on 127.0.0.1), then the store-specific parts (S3 error table and
options, mem:// fault injection, file:// fallbacks)."""
from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from acache.data.under import open_store
from acache.data.under.file import NotFoundError, clean_path
from acache.data.under.s3 import S3Store
from acache.errors import ConfigError, PermanentError, TransientError, UnderStoreError

MiB = 1 << 20


def blob(n: int, seed: int = 0) -> bytes:
    return (bytes(range(256)) * (n // 256 + 1))[seed % 256:][:n] if n < 4096 else \
        os.urandom(n)


def names(store, path=""):
    return sorted((e.name, e.is_dir) for e in store.list_dir(path))


# -- reading -----------------------------------------------------------------------

def test_check(store):
    store.check()


def test_empty_and_missing(store):
    assert list(store.list_dir("")) == []
    assert list(store.list_dir("no/such/dir")) == []
    assert store.stat("nope") is None
    assert store.stat("no/such/file") is None
    root = store.stat("")
    assert root is not None and root.is_dir


def test_read_ranges(backend, store):
    data = os.urandom(100_000)
    backend.put(store, "d/f.bin", data)
    ent = store.stat("d/f.bin")
    assert (ent.name, ent.is_dir, ent.size) == ("f.bin", False, len(data))
    assert ent.mtime > 0
    assert store.read("d/f.bin", 0, len(data)) == data
    assert store.read("d/f.bin", 10, 100) == data[10:110]
    assert store.read("d/f.bin", 99_990, 100) == data[99_990:]        # short at the end
    assert store.read("d/f.bin", 100_000, 10) == b""                  # at EOF
    assert store.read("d/f.bin", 200_000, 10) == b""                  # past EOF
    assert store.read("d/f.bin", 5, 0) == b""
    assert names(store) == [("d", True)]
    assert names(store, "d") == [("f.bin", False)]
    [e] = store.list_dir("d")
    assert e.size == len(data)


def test_read_missing_is_enoent(store):
    with pytest.raises(NotFoundError) as ei:
        store.read("missing", 0, 10)
    assert ei.value.errno == errno.ENOENT
    assert isinstance(ei.value, UnderStoreError)


def test_zero_byte_file(backend, store):
    backend.put(store, "empty", b"")
    ent = store.stat("empty")
    assert ent is not None and not ent.is_dir and ent.size == 0
    assert store.read("empty", 0, 10) == b""


def test_listing_has_no_duplicates_and_no_empty_names(backend, store):
    backend.put(store, "a/x", b"1")
    backend.put(store, "a/y/z", b"2")
    store.mkdir("a/y")
    store.mkdir("a/w")
    assert names(store, "a") == [("w", True), ("x", False), ("y", True)]


# -- stage / commit / abort / cleanup ---------------------------------------------

def test_stage_invisible_until_commit(backend, store):
    data = blob(5000)
    backend.put(store, "dir/other", b"x")
    token = store.new_token("dir/f")
    staged = store.stage("dir/f", token, backend.src(data), len(data))
    assert staged.token == token
    assert store.stat("dir/f") is None
    assert names(store, "dir") == [("other", False)]
    staged.commit()
    assert store.read("dir/f", 0, 10_000) == data
    assert names(store, "dir") == [("f", False), ("other", False)]
    staged.commit()  # idempotent
    assert backend.leftovers() == []


def test_overwrite(backend, store):
    backend.put(store, "f", b"old contents")
    backend.put(store, "f", b"new")
    assert store.read("f", 0, 100) == b"new"
    assert store.stat("f").size == 3


def test_abort_leaves_nothing(backend, store):
    backend.put(store, "keep", b"k")
    staged = store.stage("gone", store.new_token("gone"), backend.src(b"abc"), 3)
    staged.abort()
    staged.abort()
    assert store.stat("gone") is None
    assert names(store) == [("keep", False)]
    assert backend.leftovers() == []


def test_tokens_are_unique(store):
    assert store.new_token("a/b") != store.new_token("a/b")


@pytest.mark.parametrize("size", [3000, 6 * MiB])
def test_cleanup_after_crash(backend, size):
    s1 = backend.open(part_size=5 * MiB)
    token = s1.new_token("ck/shard")
    s1.stage("ck/shard", token, backend.src(blob(size)), size)
    del s1                               # crash: the Staged object is gone
    s2 = backend.open(part_size=5 * MiB)  # restart
    s2.cleanup(token)
    s2.cleanup(token)                    # idempotent
    assert backend.leftovers() == []
    assert s2.stat("ck/shard") is None


def test_cleanup_of_unused_token(store):
    store.cleanup(store.new_token("never/staged"))


def test_multipart_17mib(backend):
    store = backend.open(part_size=5 * MiB, concurrency=3)
    data = os.urandom(17 * MiB)
    seen = []
    token = store.new_token("big/model.safetensors")
    staged = store.stage("big/model.safetensors", token, backend.src(data), len(data),
                         progress=seen.append)
    assert store.stat("big/model.safetensors") is None
    staged.commit()
    assert sum(seen) == len(data)
    assert all(0 < n <= 5 * MiB for n in seen) and len(seen) >= 4
    assert store.stat("big/model.safetensors").size == len(data)
    assert store.read("big/model.safetensors", 0, len(data)) == data
    assert store.read("big/model.safetensors", 5 * MiB - 3, 6) == data[5 * MiB - 3:5 * MiB + 3]
    assert backend.leftovers() == []
    if backend.kind == "s3":
        etag = backend.s3.client().stat_object(
            backend.s3.bucket, f"{backend.prefix}/big/model.safetensors").etag
        assert etag.endswith("-4")


def test_progress_totals_small(backend, store):
    seen = []
    staged = store.stage("p", store.new_token("p"), backend.src(blob(12345)), 12345,
                         progress=seen.append)
    staged.commit()
    assert sum(seen) == 12345


def test_progress_can_interrupt_stage(backend):
    store = backend.open(part_size=5 * MiB)

    class Stop(Exception):
        pass

    def progress(n):
        raise Stop()
    token = store.new_token("x")
    with pytest.raises(Stop):
        store.stage("x", token, backend.src(os.urandom(11 * MiB)), 11 * MiB, progress)
    store.cleanup(token)
    assert backend.leftovers() == []
    assert store.stat("x") is None


def test_stage_short_source_fails(backend, store):
    with pytest.raises(PermanentError):
        store.stage("f", store.new_token("f"), backend.src(b"abc"), 10)
    assert store.stat("f") is None


def test_parallel_stages_ordered_commits(backend):
    store = backend.open(part_size=5 * MiB)
    files = {f"run/shard-{i}": os.urandom(1000 * (i + 1)) for i in range(8)}
    with ThreadPoolExecutor(8) as pool:
        staged = list(pool.map(
            lambda kv: store.stage(kv[0], store.new_token(kv[0]), backend.src(kv[1]),
                                   len(kv[1])), files.items()))
    for s in staged:
        s.commit()
    for p, d in files.items():
        assert store.read(p, 0, len(d)) == d


# -- rename / delete / mkdir / rmdir -------------------------------------------------

def test_rename_file_over_existing(backend, store):
    backend.put(store, "a", b"AAAA")
    backend.put(store, "b", b"BB")
    store.rename("a", "b")
    assert store.stat("a") is None
    assert store.read("b", 0, 10) == b"AAAA"
    store.rename("a", "b")  # a retry after a crash: src gone, dst there
    assert store.read("b", 0, 10) == b"AAAA"


def test_rename_file_into_new_dir(backend, store):
    backend.put(store, "tmp.pt", b"x")
    store.rename("tmp.pt", "ckpt/step-1/model.pt")
    assert names(store) == [("ckpt", True)]
    assert store.read("ckpt/step-1/model.pt", 0, 1) == b"x"


def test_rename_dir_tree(backend, store):
    store.mkdir("ck/step-1.tmp")
    tree = {"ck/step-1.tmp/x": b"1", "ck/step-1.tmp/sub/y": b"22", "ck/step-1.tmp/sub/z": b"3"}
    for p, d in tree.items():
        backend.put(store, p, d)
    store.mkdir("ck/step-1.tmp/empty")
    store.rename("ck/step-1.tmp", "ck/step-1")
    assert names(store, "ck") == [("step-1", True)]
    assert names(store, "ck/step-1") == [("empty", True), ("sub", True), ("x", False)]
    assert names(store, "ck/step-1/sub") == [("y", False), ("z", False)]
    assert store.read("ck/step-1/sub/y", 0, 10) == b"22"
    assert store.stat("ck/step-1.tmp") is None
    assert store.stat("ck/step-1").is_dir
    store.rename("ck/step-1.tmp", "ck/step-1")  # idempotent
    assert names(store, "ck/step-1") == [("empty", True), ("sub", True), ("x", False)]


def test_rename_dir_finishes_partial_move(s3backend):
    """S3 only: the one store that moves a directory object by object."""
    backend = s3backend
    store = backend.open()
    for i in range(5):
        backend.put(store, f"d/f{i}", b"%d" % i)
    # a crash after moving two of them
    c = backend.s3.client()
    from minio.commonconfig import CopySource
    for i in range(2):
        src = f"{backend.prefix}/d/f{i}"
        c.copy_object(backend.s3.bucket, f"{backend.prefix}/e/f{i}",
                      CopySource(backend.s3.bucket, src))
        c.remove_object(backend.s3.bucket, src)
    store.rename("d", "e")
    assert names(store, "e") == [(f"f{i}", False) for i in range(5)]
    assert store.stat("d") is None


def test_rename_errors(backend, store):
    with pytest.raises(PermanentError):
        store.rename("nothing", "here")
    store.mkdir("d")
    backend.put(store, "d/f", b"1")
    with pytest.raises(PermanentError):
        store.rename("d", "d/sub")
    with pytest.raises(PermanentError):
        store.rename("", "x")
    store.rename("d", "d")
    assert store.read("d/f", 0, 1) == b"1"


def test_delete_idempotent(backend, store):
    backend.put(store, "d/f", b"x")
    store.delete("d/f")
    assert store.stat("d/f") is None
    store.delete("d/f")
    store.delete("never/was")


def test_mkdir_rmdir(store):
    store.mkdir("a/b/c")
    store.mkdir("a/b/c")  # idempotent
    for p in ("a", "a/b", "a/b/c"):
        assert store.stat(p).is_dir, p
    assert names(store) == [("a", True)]
    assert names(store, "a/b") == [("c", True)]
    assert list(store.list_dir("a/b/c")) == []
    with pytest.raises(PermanentError):
        store.rmdir("a/b")  # not empty
    store.rmdir("a/b/c")
    assert store.stat("a/b/c") is None
    assert store.stat("a/b").is_dir
    store.rmdir("a/b/c")  # missing is fine
    store.rmdir("a/b")
    store.rmdir("a")
    assert names(store) == []


def test_rmdir_after_files_deleted(backend, store):
    store.mkdir("d")
    backend.put(store, "d/f", b"1")
    store.delete("d/f")
    store.rmdir("d")
    assert store.stat("d") is None


BAD_PATHS = ["../x", "/etc/passwd", "a/../../x", "a//b", "./a", "a/", "a/.", "a\0b", ".."]


@pytest.mark.parametrize("bad", BAD_PATHS)
def test_path_escape_rejected(backend, store, bad):
    src = backend.src(b"x")
    calls = [
        lambda: list(store.list_dir(bad)), lambda: store.stat(bad),
        lambda: store.read(bad, 0, 1), lambda: store.new_token(bad),
        lambda: store.stage(bad, "t", src, 1), lambda: store.rename(bad, "ok"),
        lambda: store.rename("ok", bad), lambda: store.delete(bad),
        lambda: store.mkdir(bad), lambda: store.rmdir(bad),
    ]
    for call in calls:
        with pytest.raises(PermanentError):
            call()
    if backend.kind == "file":
        assert not os.path.exists(os.path.join(os.path.dirname(backend.root), "x"))


def test_clean_path():
    assert clean_path("") == ""
    assert clean_path("a/b.c/..d") == "a/b.c/..d"
    for bad in BAD_PATHS:
        with pytest.raises(PermanentError):
            clean_path(bad)


@pytest.mark.parametrize("backend", ["file", "s3"], indirect=True)   # memory has no pages
def test_list_many_entries(backend):
    store = backend.open()
    n = 1100
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: backend.raw_put(f"many/k{i:05d}", b"x"), range(n)))
    got = [e.name for e in store.list_dir("many")]
    assert len(got) == n and sorted(got) == [f"k{i:05d}" for i in range(n)]


def test_entries_written_by_another_tool(backend, store):
    backend.raw_put("other/file", b"12345")
    assert names(store) == [("other", True)]
    assert store.stat("other/file").size == 5
    assert store.read("other/file", 1, 2) == b"23"


def test_open_store_by_url(backend, tmp_path):
    if backend.kind == "s3":
        st = open_store(backend.s3.url(backend.prefix), backend.s3.options())
    elif backend.kind == "file":
        st = open_store(f"file://{tmp_path}/via-url")
    else:
        st = open_store("mem://x")
    st.check()
    st.close()


# -- file:// specifics --------------------------------------------------------------

def test_file_creates_root_and_check_fails_clearly(tmp_path):
    from acache.data.under.file import FileStore
    st = FileStore(f"file://{tmp_path}/new/root")
    st.check()
    assert os.path.isdir(tmp_path / "new/root")
    (tmp_path / "plain").write_bytes(b"")
    bad = FileStore(f"file://{tmp_path}/plain/sub")
    with pytest.raises(PermanentError, match="plain/sub"):
        bad.check()
    with pytest.raises(ConfigError):
        FileStore("file://relative/path")


@pytest.mark.parametrize("backend", ["file"], indirect=True)          # the file:// layout
def test_file_temp_files_hidden_and_named(backend, tmp_path):
    store = backend.open()
    token = store.new_token("d/f")
    assert token.startswith("d/.acache-tmp.")
    store.stage("d/f", token, backend.src(b"abc"), 3)
    assert os.path.exists(os.path.join(backend.root, token))
    assert list(store.list_dir("d")) == [] and store.stat(token) is None
    store.rmdir("d")  # only a stale temp file left: removed with it
    assert not os.path.exists(os.path.join(backend.root, "d"))


def test_file_copy_fallbacks(tmp_path, monkeypatch):
    from acache.data.under.file import FileStore

    def nope(*a):
        raise OSError(errno.EXDEV, "cross-device")
    st = FileStore(f"file://{tmp_path}/u")
    data = os.urandom(9 * MiB + 7)
    src = tmp_path / "src"
    src.write_bytes(data)
    monkeypatch.setattr(os, "copy_file_range", nope)
    st.stage("a", st.new_token("a"), str(src), len(data)).commit()
    monkeypatch.setattr(os, "sendfile", nope)
    st.stage("b", st.new_token("b"), str(src), len(data)).commit()
    assert st.read("a", 0, len(data)) == data and st.read("b", 0, len(data)) == data


def test_file_commit_after_temp_removed(tmp_path):
    from acache.data.under.file import FileStore
    st = FileStore(f"file://{tmp_path}/u")
    (tmp_path / "src").write_bytes(b"abc")
    staged = st.stage("f", st.new_token("f"), str(tmp_path / "src"), 3)
    st.cleanup(staged.token)
    with pytest.raises(TransientError, match="stage again"):  # a retry stages again
        staged.commit()


def test_file_os_error_table():
    from acache.data.under.file import os_error
    for e in (errno.EACCES, errno.EROFS, errno.EPERM, errno.ENOSPC):
        assert isinstance(os_error(OSError(e, "x", "/p"), "op"), PermanentError)
    for e in (errno.EIO, errno.ESTALE, errno.ETIMEDOUT):
        assert isinstance(os_error(OSError(e, "x"), "op"), TransientError)
    assert "/p" in str(os_error(OSError(errno.EACCES, "denied", "/p"), "op"))


# -- mem:// fault injection -----------------------------------------------------------

def test_mem_fail_next_and_faults(tmp_path):
    from acache.data.under.mem import MemStore
    st = MemStore("mem://f")
    (tmp_path / "s").write_bytes(b"abc")
    st.fail_next(2, ops="stage")
    for _ in range(2):
        with pytest.raises(TransientError):
            st.stage("f", st.new_token("f"), str(tmp_path / "s"), 3)
    staged = st.stage("f", st.new_token("f"), str(tmp_path / "s"), 3)
    st.fail_next(1, PermanentError)
    with pytest.raises(PermanentError):
        staged.commit()
    staged.commit()
    assert st.read("f", 0, 3) == b"abc"
    st.faults = lambda op, path: (_ for _ in ()).throw(TransientError("down")) \
        if op == "read" else None
    with pytest.raises(TransientError, match="down"):
        st.read("f", 0, 3)
    st.faults = None
    assert ("stage", "f") in st.calls and ("commit", "f") in st.calls


def test_mem_delay_and_state(tmp_path):
    from acache.data.under.mem import MemStore
    a = MemStore("mem://same", delay=0.05)
    t = time.monotonic()
    a.stat("x")
    assert time.monotonic() - t >= 0.05
    a.mkdir("d")
    assert MemStore("mem://same").stat("d") is None       # no hidden global state
    assert a.reopen().stat("d").is_dir                      # a restart sees it
    assert open_store("mem://same").stat("d") is None


# -- s3:// specifics ------------------------------------------------------------------

def _s3error(code, status):
    from minio.error import S3Error

    class R:
        pass
    r = R()
    r.status = status
    return S3Error(r, code, "msg", "/bkt/key", "req", "host", "bkt", "key")


@pytest.mark.parametrize("code,status,kind", [
    ("AccessDenied", 403, PermanentError), ("NoSuchBucket", 404, PermanentError),
    ("InvalidAccessKeyId", 403, PermanentError), ("SignatureDoesNotMatch", 403, PermanentError),
    ("InvalidBucketName", 400, PermanentError), ("SlowDown", 503, TransientError),
    ("InternalError", 500, TransientError), ("RequestTimeout", 400, TransientError),
    ("ServiceUnavailable", 503, TransientError), ("SomethingNew", 502, TransientError),
    ("SomethingNew", 400, PermanentError),
])
def test_s3_error_table_codes(code, status, kind):
    from acache.data.under.s3 import translate
    err = translate(_s3error(code, status), "s3 put s3://bkt/key at http://h:1")
    assert type(err) is kind
    assert code in str(err) and "bkt" in str(err) and "http://h:1" in str(err)


def test_s3_error_table_transport():
    import ssl

    from minio.error import InvalidResponseError, ServerError
    from urllib3.exceptions import (MaxRetryError, NewConnectionError, ProtocolError,
                                    ReadTimeoutError, SSLError)

    from acache.data.under.s3 import translate
    w = "s3 get s3://b/k at http://h:1"
    refused = NewConnectionError(None, "Connection refused")
    for e in (refused, MaxRetryError(None, "/", refused),
              ReadTimeoutError(None, "/", "timed out"),
              ProtocolError("reset", ConnectionResetError(104, "reset")),
              ConnectionRefusedError(111, "refused"), TimeoutError("t"),
              ServerError("x", 503), InvalidResponseError(502, "text/html", "bad gw")):
        assert type(translate(e, w)) is TransientError, e
    for e in (SSLError("cert"), MaxRetryError(None, "/", SSLError("cert")),
              ssl.SSLCertVerificationError("x"), InvalidResponseError(403, "text/html", "no"),
              ValueError("invalid object name")):
        assert type(translate(e, w)) is PermanentError, e
    assert translate(KeyError("x"), w) is None


def test_s3_options_precedence():
    from acache.data.under.s3 import resolve_options
    env = {"AWS_ENDPOINT_URL": "http://aws:1", "AWS_REGION": "aws-r",
           "AWS_ACCESS_KEY_ID": "awsk", "AWS_SECRET_ACCESS_KEY": "awss",
           "ACACHE_S3_REGION": "acache-r", "ACACHE_S3_PART_SIZE": str(8 * MiB)}
    o = resolve_options({}, env)
    assert (o["endpoint"], o["region"], o["access_key"], o["secret_key"], o["part_size"]) == \
        ("http://aws:1", "acache-r", "awsk", "awss", 8 * MiB)
    env.update(ACACHE_S3_ACCESS_KEY="ak", ACACHE_S3_SECRET_KEY="as")
    o = resolve_options({"region": "kw", "concurrency": 3}, env)
    assert (o["region"], o["access_key"], o["secret_key"], o["concurrency"]) == \
        ("kw", "ak", "as", 3)
    o = resolve_options({"access_key": "k", "secret_key": "s"}, env)
    assert (o["access_key"], o["secret_key"]) == ("k", "s")
    assert resolve_options({}, {})["access_key"] is None
    assert resolve_options({}, {"ACACHE_S3_VERIFY_TLS": "false"})["verify_tls"] is False
    for bad in ({"part_size": MiB}, {"concurrency": 0}, {"addressing": "x"}, {"nope": 1},
                {"access_key": "only"}):
        with pytest.raises(ConfigError):
            resolve_options(bad, {})


def test_s3_bad_urls():
    from acache.data.under.s3 import S3Store
    for url in ("s3://", "s3://Bad_Bucket!/x", "s3://bkt/../x", "s3://bkt/a?b=c"):
        with pytest.raises(ConfigError):
            S3Store(url, endpoint="http://127.0.0.1:1")
    with pytest.raises(ConfigError):
        S3Store("s3://bkt", endpoint="ftp://x")


def test_s3_env_configures_store(s3server, monkeypatch):
    for k, v in s3server.env().items():
        monkeypatch.setenv(k, v)
    st = open_store(s3server.url("envtest"))
    st.check()
    st.close()


def test_s3_keys_stay_under_prefix(s3backend):
    store = s3backend.open()
    s3backend.put(store, "a/b", b"1")
    store.mkdir("m/n")
    store.rename("a", "c")
    store.check()
    mine = [k for k in s3backend.raw_keys() if not k.startswith("t-") or
            k.startswith(s3backend.prefix + "/")]
    assert mine and all(k.startswith(s3backend.prefix + "/") for k in mine)


def test_s3_dir_markers_from_other_tool(s3backend):
    store = s3backend.open()
    s3backend.raw_put("a/", b"")
    s3backend.raw_put("a/b/", b"")
    s3backend.raw_put("c", b"file")
    s3backend.raw_put("e/", b"")
    s3backend.raw_put("e/f", b"x")
    assert names(store) == [("a", True), ("c", False), ("e", True)]
    assert names(store, "a") == [("b", True)]
    assert names(store, "e") == [("f", False)]
    assert store.stat("a").is_dir and store.stat("a/b").is_dir
    store.rmdir("a/b")
    assert names(store, "a") == []


def test_s3_cleanup_only_its_key(s3backend):
    store = s3backend.open(part_size=5 * MiB)
    src = s3backend.src(os.urandom(6 * MiB))
    t1 = store.new_token("a/b")
    store.stage("a/b", t1, src, 6 * MiB)
    other = store.stage("a/bc", store.new_token("a/bc"), src, 6 * MiB)
    store.cleanup(t1)
    assert [k for k, _ in s3backend.leftovers()] == [f"{s3backend.prefix}/a/bc"]
    other.commit()
    assert s3backend.leftovers() == []


def test_s3_cleanup_spares_live_stages_of_the_same_key(s3backend):
    crashed = s3backend.open(part_size=5 * MiB)
    src = s3backend.src(os.urandom(6 * MiB))
    t0 = crashed.new_token("f")
    crashed.stage("f", t0, src, 6 * MiB)           # its process dies
    store = s3backend.open(part_size=5 * MiB)
    t1, t2 = store.new_token("f"), store.new_token("f")
    s1 = store.stage("f", t1, src, 6 * MiB)
    s2 = store.stage("f", t2, src, 6 * MiB)
    store.cleanup(t0)                              # recovery of the crashed stage
    assert sorted(u for _, u in s3backend.leftovers()) == sorted([s1.upload_id, s2.upload_id])
    store.cleanup(t1)                              # e.g. the first version was deleted
    assert [u for _, u in s3backend.leftovers()] == [s2.upload_id]
    s2.commit()
    assert s3backend.leftovers() == []
    assert store.stat("f").size == 6 * MiB


def test_s3_multipart_threshold(s3backend):
    """From multipart_threshold up, the bytes move in stage() (a one-part multipart
    upload); the commit is only CompleteMultipartUpload.  Below it, one PutObject."""
    store = s3backend.open(part_size=5 * MiB, multipart_threshold=MiB)
    mid, small = os.urandom(2 * MiB), os.urandom(1000)
    s_mid = store.stage("mid", store.new_token("mid"), s3backend.src(mid), len(mid))
    s_small = store.stage("small", store.new_token("small"), s3backend.src(small), len(small))
    assert s_mid.upload_id is not None and s_small.upload_id is None
    assert len(s3backend.leftovers()) == 1 and store.stat("mid") is None
    s_mid.commit()
    s_small.commit()
    assert store.read("mid", 0, len(mid)) == mid and store.read("small", 0, 1000) == small
    assert s3backend.leftovers() == []


@pytest.mark.parametrize("size", [1000, 6 * MiB])
def test_s3_bytes_changed_in_flight_are_caught(s3backend, size):
    """moto does not check Content-MD5: bytes corrupted on the way are stored, and
    the ETag check (part ETag, or PutObject ETag, == MD5 of what was read) catches it.
    (auto would leave MD5 off here: http with credentials, the signed SHA-256 is what a real
    server checks; moto checks neither.)"""
    store = s3backend.open(part_size=5 * MiB, content_md5="true")
    put, part = store.wire.put, store.wire.upload_part

    def flip(data: bytes) -> bytes:
        return bytes([data[0] ^ 1]) + data[1:]
    store.wire.put = lambda key, data, md5, *meta: put(key, flip(data), md5, *meta)
    store.wire.upload_part = lambda key, uid, n, data, md5: part(key, uid, n, flip(data), md5)
    data = os.urandom(size)
    with pytest.raises(PermanentError, match="ETag"):
        store.stage("f", store.new_token("f"), s3backend.src(data), size).commit()


def test_s3_small_file_is_read_again_at_commit_past_the_hold_limit(s3backend):
    """Past HOLD_BYTES a small file's stage keeps its MD5, not its bytes; commit reads
    the cache file again: gone by then is transient (the persister stages again)."""
    store = s3backend.open()
    store.hold_limit = 1500
    kept = store.stage("k", store.new_token("k"), s3backend.src(b"k" * 1000), 1000)
    src = s3backend.src(b"x" * 1000)
    staged = store.stage("f", store.new_token("f"), src, 1000)
    assert kept._data is not None and staged._data is None and store._held == 1000
    os.unlink(src)
    with pytest.raises(TransientError):
        staged.commit()
    assert store.stat("f") is None
    kept.abort()
    assert store._held == 0


def test_s3_small_file_commit_sends_the_bytes_read_at_stage(s3backend):
    """Within HOLD_BYTES the bytes read at stage() are what commit() sends: the ordered
    commit, which the next one waits for, reads no file.  What is held is given back
    at commit, at abort, and when the PutObject fails."""
    store = s3backend.open()
    data = os.urandom(1000)
    src = s3backend.src(data)
    staged = store.stage("f", store.new_token("f"), src, len(data))
    assert store._held == len(data)
    os.unlink(src)
    staged.commit()
    assert store.read("f", 0, len(data)) == data and store._held == 0
    store.stage("g", store.new_token("g"), s3backend.src(data), len(data)).abort()
    assert store._held == 0
    put = store.wire.put

    def fail(*a):
        raise TransientError("injected")
    store.wire.put = fail
    staged = store.stage("h", store.new_token("h"), s3backend.src(data), len(data))
    with pytest.raises(TransientError):
        staged.commit()
    assert store._held == 0 and store.stat("h") is None
    store.wire.put = put


@pytest.mark.parametrize("endpoint,creds,want", [
    ("http://127.0.0.1:9", True, False),      # body SHA-256 signed, checked by the server
    ("https://127.0.0.1:9", True, True),      # UNSIGNED-PAYLOAD: only an MD5 covers it
    ("http://127.0.0.1:9", False, True),      # anonymous: nothing signed
])
def test_s3_content_md5_auto(endpoint, creds, want, monkeypatch):
    for k in [k for k in os.environ if k.startswith(("ACACHE_S3_", "AWS_"))]:
        monkeypatch.delenv(k)
    kw = {"access_key": "a", "secret_key": "b"} if creds else {}
    assert S3Store("s3://bkt/p", endpoint=endpoint, **kw).content_md5 is want
    assert S3Store("s3://bkt/p", endpoint=endpoint, content_md5=" Auto", **kw).content_md5 is want
    assert S3Store("s3://bkt/p", endpoint=endpoint, content_md5="true", **kw).content_md5 is True


def test_s3_content_md5_off(s3backend):
    store = s3backend.open(part_size=5 * MiB, content_md5="false")
    assert store.content_md5 is False
    for size in (1000, 6 * MiB):
        data = os.urandom(size)
        store.stage("f", store.new_token("f"), s3backend.src(data), size).commit()
        assert store.read("f", 0, size) == data
    assert s3backend.leftovers() == []


def test_s3_commit_of_aborted_upload_is_transient(s3backend):
    store = s3backend.open(part_size=5 * MiB)
    staged = store.stage("f", store.new_token("f"), s3backend.src(os.urandom(6 * MiB)), 6 * MiB)
    store.wire.abort(staged.key, staged.upload_id)      # e.g. a bucket lifecycle rule
    with pytest.raises(TransientError):  # S3: NoSuchUpload (moto answers a 500)
        staged.commit()
    assert store.stat("f") is None


def test_s3_commit_after_lost_reply(s3backend):
    store = s3backend.open(part_size=5 * MiB)
    data = os.urandom(6 * MiB)
    staged = store.stage("f", store.new_token("f"), s3backend.src(data), len(data))
    # the server completed it but the reply was lost
    store.wire.complete(staged.key, staged.upload_id, staged._parts)
    staged.commit()
    assert store.read("f", 0, len(data)) == data


def test_s3_missing_bucket(s3server):
    from acache.data.under.s3 import S3Store
    st = S3Store("s3://no-such-bucket-here/p", **s3server.options())
    with pytest.raises(PermanentError, match="no-such-bucket-here.*NoSuchBucket"):
        st.check()


def test_s3_wrong_credentials(s3auth):
    from acache.data.under.s3 import S3Store
    S3Store(s3auth.url("p"), **s3auth.options()).check()
    with pytest.raises(PermanentError, match="InvalidAccessKeyId"):
        S3Store(s3auth.url("p"), **s3auth.options(access_key="AKIAWRONGWRONG")).check()
    st = S3Store(s3auth.url("p"), **s3auth.options(secret_key="wrong"))
    with pytest.raises(PermanentError, match="SignatureDoesNotMatch"):
        st.check()
    with pytest.raises(PermanentError):
        st.stat("x")


def test_s3_server_down_is_transient(tmp_path):
    from acache.data.under.s3 import S3Store
    from tests.s3server import S3Server
    with S3Server() as srv:
        st = S3Store(srv.url("p"), **srv.options())
        (tmp_path / "s").write_bytes(b"abc")
        st.stage("f", st.new_token("f"), str(tmp_path / "s"), 3).commit()
        srv.stop()
        t = time.monotonic()
        for call in (lambda: st.stat("f"), lambda: st.read("f", 0, 3),
                     lambda: list(st.list_dir("")), st.check):
            with pytest.raises(TransientError, match="cannot reach"):
                call()
        assert time.monotonic() - t < 20
        srv.start()
        assert st.read("f", 0, 3) == b"abc"


def test_s3_https(tmp_path):
    from acache.data.under.s3 import S3Store
    from tests.s3server import S3Server
    with S3Server(tls=True) as srv:
        st = S3Store(srv.url("p"), **srv.options())
        with pytest.warns(Warning):  # urllib3: unverified HTTPS
            st.check()
        with pytest.raises(PermanentError, match="TLS"):
            S3Store(srv.url("p"), **srv.options(verify_tls=True)).check()


def test_s3_part_etag_mismatch_is_permanent(s3backend, monkeypatch):
    store = s3backend.open(part_size=5 * MiB, content_md5="true")
    monkeypatch.setattr(store.wire, "upload_part", lambda *a: "0" * 32)
    token = store.new_token("f")
    with pytest.raises(PermanentError, match="ETag"):
        store.stage("f", token, s3backend.src(os.urandom(6 * MiB)), 6 * MiB)
    store.cleanup(token)
    assert s3backend.leftovers() == []


def test_s3_many_parts_grow_part_size():
    from acache.data.under.s3 import S3Store
    st = S3Store("s3://bkt", endpoint="http://127.0.0.1:1", part_size=5 * MiB)
    assert st._part_size_for(10 * MiB) == 5 * MiB
    big = 100_000 * MiB
    ps = st._part_size_for(big)
    assert -(-big // ps) <= 10_000 and ps % MiB == 0


def test_close_ends_worker_threads(backend):
    def ours():
        return [t for t in threading.enumerate() if t.name.startswith("acache-")]
    before = len(ours())
    store = backend.open(part_size=5 * MiB)
    backend.put(store, "f", os.urandom(6 * MiB))
    store.close()
    assert len(ours()) == before


def test_s3_recorded_upload_id_cleans_exactly_that_upload(s3backend):
    """A stage hands the upload id to on_token before any part: cleanup of that token
    aborts that upload only -- never another node's live upload on the same key, which a
    shared prefix (a cluster: exclusive = False) has, nor a second stage of this node."""
    foreign = s3backend.open(part_size=5 * MiB)      # another node on the same prefix
    src = s3backend.src(os.urandom(6 * MiB))
    theirs = foreign.stage("ck/shard", foreign.new_token("ck/shard"), src, 6 * MiB)
    crashed = s3backend.open(part_size=5 * MiB)
    seen: list[str] = []
    t0 = crashed.new_token("ck/shard")
    mine = crashed.stage("ck/shard", t0, src, 6 * MiB, on_token=seen.append)
    assert len(seen) == 1 and seen[0] != t0 and mine.token == seen[0]
    assert mine.upload_id in seen[0] and seen[0].endswith("\nck/shard")
    del crashed                                      # crash: only the recorded token is left
    restarted = s3backend.open(part_size=5 * MiB)
    restarted.exclusive = False
    restarted.cleanup(t0)          # the token before the id was known: not told apart, kept
    assert sorted(u for _, u in s3backend.leftovers()) == sorted([theirs.upload_id, mine.upload_id])
    restarted.cleanup(seen[0])
    restarted.cleanup(seen[0])                       # idempotent (NoSuchUpload)
    assert [u for _, u in s3backend.leftovers()] == [theirs.upload_id]
    theirs.commit()
    assert restarted.stat("ck/shard").size == 6 * MiB
    assert s3backend.leftovers() == []


def test_s3_unrecorded_token_on_exclusive_prefix_lists_the_key(s3backend):
    """One host (exclusive, the default): a token whose id was never recorded (a crash
    between CreateMultipartUpload and the record) is still cleaned by listing its key."""
    crashed = s3backend.open(part_size=5 * MiB)
    src = s3backend.src(os.urandom(6 * MiB))
    t0 = crashed.new_token("f")
    crashed.stage("f", t0, src, 6 * MiB)
    del crashed
    store = s3backend.open(part_size=5 * MiB)
    assert store.exclusive
    store.cleanup(t0)
    assert s3backend.leftovers() == []


def test_s3_failing_token_record_undoes_the_stage(s3backend):
    """If the id cannot be recorded (the metadata write failed), the stage fails and
    leaves no upload behind."""
    store = s3backend.open(part_size=5 * MiB)
    src = s3backend.src(os.urandom(6 * MiB))

    from acache.errors import MetaError

    def refuse(token: str) -> None:
        raise MetaError("metadata write failed")
    with pytest.raises(MetaError, match="metadata write failed"):
        store.stage("g", store.new_token("g"), src, 6 * MiB, on_token=refuse)
    assert s3backend.leftovers() == []
