"""s3:// end to end: a real node + FUSE mount over moto's S3 server on 127.0.0.1.

Engine-dependent paths (writes, reads, renames through the mount) run on every engine;
the S3 behaviour around them (credentials, crash, outage) on one engine.  Traffic is
counted from what the server saw: moto's request log (srv.requests()) and the relay's
byte counters (srv.bytes_up / bytes_down).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.acache_node import ACACHE, AcacheNode, fuse_mounts
from tests.e2e.conftest import ALL_ENGINES, ENGINES
from tests.s3server import S3Server

MiB = 1 << 20
ONE_ENGINE = ENGINES[-1]


# -- fixtures and helpers ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv():
    """One moto server for the module (each test has its own prefix)."""
    with S3Server() as s:
        yield s


@pytest.fixture
def prefix():
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def nodes(tmp_path):
    """A factory of AcacheNodes (keyword arguments as AcacheNode; engine defaults to the
    single engine of the engine-independent tests), all stopped and checked unmounted."""
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.fail("e2e tests need /dev/fuse and root")
    made: list[AcacheNode] = []

    def make(start: bool = True, engine: str = ONE_ENGINE, **kw) -> AcacheNode:
        n = AcacheNode(tmp_path / f"n{len(made)}", engine=engine, **kw)
        made.append(n)
        if start:
            n.start()
        return n
    yield make
    for n in made:
        n.stop()
    left = [m for m in fuse_mounts() if m.startswith(str(tmp_path))]
    assert not left, f"mounts left behind: {left}"


def s3_node(make, srv: S3Server, prefix: str, *, engine: str = ONE_ENGINE, start: bool = True,
            flush_delay: float = 0.2, **s3) -> AcacheNode:
    """A node over s3://bucket/prefix with the server's options as ACACHE_S3_* env."""
    env = {f"ACACHE_S3_{k.upper()}": str(v) for k, v in srv.options(**s3).items()}
    return make(start=start, engine=engine, ufs=srv.url(prefix), flush_delay=flush_delay,
                extra_env=env)


def bucket_files(srv: S3Server, prefix: str) -> dict[str, bytes]:
    """Every object under prefix/ (markers excluded): relative key -> bytes."""
    return srv.objects(prefix)


def put(srv: S3Server, key: str, data: bytes) -> None:
    srv.client().put_object(srv.bucket, key, io.BytesIO(data), len(data))


def one_line_error(p: subprocess.CompletedProcess) -> str:
    """A failed CLI call: non-zero, one line on stderr, no traceback."""
    assert p.returncode != 0, p
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


def mount_files(root) -> dict[str, bytes]:
    """Every file under root (read by 8 threads): relative path -> bytes."""
    paths = [os.path.join(d, n) for d, _, names in os.walk(root) for n in names]

    def read(p: str) -> bytes:
        with open(p, "rb") as f:
            return f.read()
    with ThreadPoolExecutor(8) as ex:
        return {os.path.relpath(p, root): b for p, b in zip(paths, ex.map(read, paths))}


# -- configuration: where the endpoint and credentials come from -----------------------------
@pytest.mark.parametrize("source", ["config", "acache_env", "aws_env"])
def test_up_with_s3_options_from(source, srv, prefix, nodes):
    o = srv.options()
    if source == "config":
        kw = {"config": "[s3]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in o.items())
              + 'part_size = "8MiB"\n'}
    elif source == "acache_env":
        kw = {"extra_env": {f"ACACHE_S3_{k.upper()}": str(v) for k, v in o.items()}}
    else:
        kw = {"extra_env": {"AWS_ENDPOINT_URL": o["endpoint"], "AWS_REGION": o["region"],
                            "AWS_ACCESS_KEY_ID": o["access_key"],
                            "AWS_SECRET_ACCESS_KEY": o["secret_key"]}}
    n = nodes(ufs=srv.url(prefix), **kw)
    (n.mnt / "hello.txt").write_bytes(b"hello " + source.encode())
    n.flush()
    assert bucket_files(srv, prefix) == {"hello.txt": b"hello " + source.encode()}
    assert n.status()["ufs"] == srv.url(prefix)


# -- reading what is already there -------------------------------------------------------------
@pytest.fixture(scope="module")
def existing(srv):
    """A prefix written by minio directly: 1,001 keys in one directory (more than a
    ListObjectsV2 page), nested keys with and without dir/ markers, an empty directory
    that is only a marker, and a file bigger than a read-through chunk."""
    pre = f"pre-{uuid.uuid4().hex[:8]}"
    rnd = random.Random(7)
    files = {f"flat/k{i:04d}": rnd.randbytes(rnd.randrange(0, 300)) for i in range(1001)}
    files.update({"a/b/c.bin": rnd.randbytes(1000), "a/top.txt": b"top",
                  "m/x.bin": rnd.randbytes(5000), "m/sub/y": b"y", "zero": b"",
                  "big.bin": rnd.randbytes(9 * MiB + 123)})
    markers = ["m/", "m/sub/", "empty/"]
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda kv: put(srv, f"{pre}/{kv[0]}", kv[1]), files.items()))
        list(ex.map(lambda k: put(srv, f"{pre}/{k}", b""), markers))
    return pre, files


@pytest.mark.parametrize("engine", ALL_ENGINES)
def test_existing_objects_show_and_read(engine, existing, srv, nodes):
    pre, files = existing
    n = s3_node(nodes, srv, pre, engine=engine)
    mark = len(srv.requests())
    assert sorted(os.listdir(n.mnt)) == ["a", "big.bin", "empty", "flat", "m", "zero"]
    assert len(os.listdir(n.mnt / "flat")) == 1001
    assert os.listdir(n.mnt / "empty") == []
    assert sorted(os.listdir(n.mnt / "m")) == ["sub", "x.bin"]
    assert (n.mnt / "flat" / "k0500").stat().st_size == len(files["flat/k0500"])
    assert mount_files(n.mnt) == files
    # the listing and the reads came from S3; nothing was written back
    assert not [r for r in _since(srv, mark) if r[0] in ("PUT", "POST", "DELETE")]


# -- persisting a checkpoint -------------------------------------------------------------------
@pytest.mark.parametrize("engine", ALL_ENGINES)
def test_checkpoint_lands_byte_identical(engine, srv, prefix, nodes):
    n = s3_node(nodes, srv, prefix, engine=engine, part_size=5 * MiB)
    ck = n.mnt / "ckpt" / "step-100"
    ck.mkdir(parents=True)
    rnd = random.Random(1)
    want = {"ckpt/step-100/model.bin": rnd.randbytes(21 * MiB + 7),     # 5 parts
            "ckpt/step-100/optim.bin": rnd.randbytes(6 * MiB),          # 2 parts
            "ckpt/step-100/rng.pt": rnd.randbytes(3000),                # one PUT
            "ckpt/step-100/empty": b""}
    for rel, data in want.items():
        with open(n.mnt / rel, "wb") as f:
            f.write(data)
    (ck / ".metadata.tmp").write_bytes(b'{"step": 100}')
    os.rename(ck / ".metadata.tmp", ck / ".metadata")
    want["ckpt/step-100/.metadata"] = b'{"step": 100}'
    n.flush()
    got = bucket_files(srv, prefix)
    assert got.keys() == want.keys()
    for k in want:
        assert hashlib.sha256(got[k]).digest() == hashlib.sha256(want[k]).digest(), k
    st = srv.client().stat_object(srv.bucket, f"{prefix}/ckpt/step-100/model.bin")
    assert st.etag.strip('"').endswith("-5")      # a multipart upload of 5 parts
    assert srv.open_uploads(prefix=prefix + "/") == []
    assert {f["state"] for f in n.status(str(ck))["files"]} == {"persisted"}


# -- crash during a multipart upload -----------------------------------------------------------
def test_kill9_during_multipart_upload(srv, prefix, nodes):
    n = s3_node(nodes, srv, prefix, part_size=5 * MiB)
    rnd = random.Random(2)
    want = {"small.bin": rnd.randbytes(1000), "big.bin": rnd.randbytes(40 * MiB + 5)}
    srv.throttle = 4 * MiB        # 40 MiB takes ~10 s: still uploading when killed
    try:
        for name, data in want.items():
            (n.mnt / name).write_bytes(data)
        up0 = srv.bytes_up
        deadline = time.monotonic() + 30
        while not (srv.open_uploads(prefix=prefix + "/") and srv.bytes_up - up0 > 6 * MiB):
            assert time.monotonic() < deadline, "the multipart upload did not start"
            time.sleep(0.1)
        n.kill9()
    finally:
        srv.throttle = None
    assert srv.open_uploads(prefix=prefix + "/"), "the upload finished before the kill"
    assert "big.bin" not in bucket_files(srv, prefix)
    # another writer's upload on the same key (another node of a cluster, another tool):
    # recovery aborts the killed stage's own upload, whose id its entry recorded, not this
    key = f"{prefix}/big.bin"
    theirs = srv.client()._create_multipart_upload(srv.bucket, key, {})
    n.restart()
    n.flush()
    assert bucket_files(srv, prefix) == want
    assert srv.open_uploads(prefix=prefix + "/") == [(key, theirs)]
    srv.client()._abort_multipart_upload(srv.bucket, key, theirs)


# -- an S3 outage in the middle of persisting --------------------------------------------------
def test_s3_outage_30s_nothing_lost(prefix, nodes):
    with S3Server() as s:
        n = s3_node(nodes, s, prefix, part_size=5 * MiB)
        rnd = random.Random(3)
        want = {f"shard-{i}.bin": rnd.randbytes(12 * MiB + i) for i in range(3)}
        want["latest"] = b"100"
        s.throttle = 8 * MiB
        for name, data in want.items():
            (n.mnt / name).write_bytes(data)
        up0 = s.bytes_up
        while s.bytes_up - up0 < 8 * MiB:          # in the middle of persisting
            time.sleep(0.05)
        s.stop()
        t_stop = time.monotonic()
        s.throttle = None
        flush = subprocess.Popen([*ACACHE, "flush", "--wait"], env=n.env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 20
            while "retrying" not in (err := n.status()["last_error"]):
                assert time.monotonic() < deadline, f"no retrying error in status: {err!r}"
                time.sleep(0.5)
            assert "cannot reach" in err
            assert flush.poll() is None, "flush --wait returned while S3 was down"
            time.sleep(max(0.0, 30 - (time.monotonic() - t_stop)))
            assert flush.poll() is None
            s.start()
            out, errs = flush.communicate(timeout=60)
        finally:
            if flush.poll() is None:
                flush.kill()
                flush.wait()
        assert flush.returncode == 0, errs
        assert bucket_files(s, prefix) == want
        assert s.open_uploads(prefix=prefix + "/") == []
        assert n.status()["last_error"] == ""
        n.stop()


def test_unreachable_s3_at_start_does_not_stop_up(prefix, nodes):
    """A node restarted during an outage starts (a warning in the log) and takes writes;
    they land when S3 is back.  (Only bad credentials or a missing bucket refuse `up`.)"""
    with S3Server() as s:
        n = s3_node(nodes, s, prefix)
        (n.mnt / "before").write_bytes(b"before")
        n.flush()
        n.cli("down")
        s.stop()
        n.restart()                              # up + mount while S3 is unreachable
        assert "unreachable" in n.log_tail(200)
        (n.mnt / "run1").mkdir()
        (n.mnt / "run1" / "f").write_bytes(b"written while S3 was down")
        assert n.status()["queue"] >= 2
        s.start()
        n.flush(timeout=60)
        assert bucket_files(s, prefix) == {"before": b"before",
                                           "run1/f": b"written while S3 was down"}
        n.stop()


# -- wrong credentials -------------------------------------------------------------------------
def test_wrong_credentials_reported_nothing_lost(prefix, nodes):
    with S3Server(auth=True) as s:
        bad = s3_node(nodes, s, prefix, start=False, secret_key="not-the-secret")
        line = one_line_error(bad.cli("up", check=False))
        assert "SignatureDoesNotMatch" in line and "secret key" in line, line

        n = s3_node(nodes, s, prefix)
        want = {"a.bin": os.urandom(100_000), "d/b.bin": os.urandom(6 * MiB)}
        (n.mnt / "warmup").write_bytes(b"ok")
        n.flush()
        old_key = s.access_key
        s.access_key, s.secret_key = s.new_key()
        s.revoke_key(old_key)                  # the running node's key is gone
        (n.mnt / "d").mkdir()
        for name, data in want.items():
            (n.mnt / name).write_bytes(data)
        p = n.cli("flush", "--wait", "--timeout", "60", check=False)
        line = one_line_error(p)
        assert "InvalidAccessKeyId" in line and "cleanup" not in line, line
        st = n.status(str(n.mnt))
        assert "InvalidAccessKeyId" in st["last_error"] and st["failed"] >= 1
        states = {f["path"]: f["state"] for f in st["files"]}
        assert states["warmup"] == "persisted"
        assert states["a.bin"] != "persisted" and states["d/b.bin"] != "persisted", states

        n.cli("down", "--no-flush")
        line = one_line_error(n.cli("up", check=False))       # the node refuses the old key
        assert "InvalidAccessKeyId" in line, line
        n.env.update({"ACACHE_S3_ACCESS_KEY": s.access_key, "ACACHE_S3_SECRET_KEY": s.secret_key})
        n.restart()
        n.flush()
        assert bucket_files(s, prefix) == {"warmup": b"ok", **want}
        n.stop()


# -- renames and deletes -----------------------------------------------------------------------
def _since(srv: S3Server, mark: int) -> list[tuple[str, str, str, int]]:
    return srv.requests()[mark:]


@pytest.mark.parametrize("engine", ALL_ENGINES)
def test_rename_persisted_file_and_directory(engine, srv, prefix, nodes):
    n = s3_node(nodes, srv, prefix, engine=engine)
    big = os.urandom(6 * MiB)
    (n.mnt / "f.bin").write_bytes(big)
    (n.mnt / "d" / "sub").mkdir(parents=True)
    tree = {"d/x": b"x" * 1000, "d/y": b"y" * 2000, "d/sub/z": os.urandom(3 * MiB)}
    for rel, data in tree.items():
        (n.mnt / rel).write_bytes(data)
    n.flush()
    mark, up0 = len(srv.requests()), srv.bytes_up
    os.rename(n.mnt / "f.bin", n.mnt / "g.bin")
    os.rename(n.mnt / "d", n.mnt / "e")
    n.flush()
    reqs = _since(srv, mark)
    want = {"g.bin": big, **{"e" + k[1:]: v for k, v in tree.items()}}
    assert bucket_files(srv, prefix) == want
    # server-side copies: the bytes did not travel again
    assert srv.bytes_up - up0 < 256 * 1024, srv.bytes_up - up0
    assert not [r for r in reqs if r[0] == "GET" and r[1] and not r[2]], reqs   # no download
    k = lambda rel: f"{prefix}/{rel}"
    assert ("PUT", k("g.bin")) in [(m, key) for m, key, *_ in reqs]
    # the source goes by one DeleteObjects (with a link at the new name, which it replaces)
    assert ("POST", "", "delete") in [(m, key, q.rstrip("=")) for m, key, q, *_ in reqs], reqs
    for rel in tree:
        assert ("PUT", k("e" + rel[1:])) in [(m, key) for m, key, *_ in reqs], rel
    assert srv.client().stat_object(srv.bucket, k("e/sub/")) is not None   # the marker moved
    assert list(srv.client().list_objects(srv.bucket, k("d/"), recursive=True)) == []
    assert mount_files(n.mnt) == want


@pytest.mark.parametrize("engine", ALL_ENGINES)
def test_unpersisted_rename_and_delete_cost_no_s3_request(engine, srv, prefix, nodes):
    n = s3_node(nodes, srv, prefix, engine=engine, flush_delay=30)
    os.listdir(n.mnt)                        # the root is listed once, before the mark
    mark = len(srv.requests())
    data = os.urandom(9 * MiB)               # multipart, if it were uploaded
    (n.mnt / "tmp-name.bin").write_bytes(data)
    os.rename(n.mnt / "tmp-name.bin", n.mnt / "final.bin")
    (n.mnt / "discard.bin").write_bytes(os.urandom(6 * MiB))
    os.unlink(n.mnt / "discard.bin")
    (n.mnt / "olddir").mkdir()
    (n.mnt / "olddir" / "inner").write_bytes(b"inner")
    os.rename(n.mnt / "olddir", n.mnt / "newdir")
    (n.mnt / "gone-dir").mkdir()
    (n.mnt / "gone-dir" / "x").write_bytes(b"x")
    os.unlink(n.mnt / "gone-dir" / "x")
    os.rmdir(n.mnt / "gone-dir")
    n.flush()
    assert bucket_files(srv, prefix) == {"final.bin": data, "newdir/inner": b"inner"}
    reqs = _since(srv, mark)
    assert reqs, "no requests were logged at all"
    for name in ("tmp-name.bin", "discard.bin", "olddir", "gone-dir"):
        hits = [r for r in reqs if name in r[1] or name in r[2]]
        assert not hits, f"S3 requests for the discarded name {name}: {hits}"


# -- cold reads --------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ALL_ENGINES)
def test_cold_random_reads_use_large_ranged_gets(engine, srv, prefix, nodes):
    size = 40 * MiB + 333
    data = random.Random(4).randbytes(size)
    put(srv, f"{prefix}/cold.bin", data)
    n = s3_node(nodes, srv, prefix, engine=engine)
    mark, down0 = len(srv.requests()), srv.bytes_down
    rnd = random.Random(5)
    fd = os.open(n.mnt / "cold.bin", os.O_RDONLY)
    try:
        for _ in range(1000):
            off = rnd.randrange(0, size - 4096)
            assert os.pread(fd, 4096, off) == data[off:off + 4096]
    finally:
        os.close(fd)
    gets = [r for r in _since(srv, mark) if r[0] == "GET" and r[1] == f"{prefix}/cold.bin"]
    chunks = -(-size // (8 * MiB))                    # 8 MiB read-through chunks
    assert 1 <= len(gets) <= chunks, len(gets)       # each chunk fetched once: >= 8 MiB per GET
    assert srv.bytes_down - down0 < size + 1 * MiB
    assert n.status()["ufs_reads"] <= chunks


# -- https ------------------------------------------------------------------------------------
def test_checkpoint_lands_over_https(prefix, nodes):
    """An https endpoint (moto --ssl, self-signed: verify_tls=false): the bytes land
    byte-identical, multipart included; content_md5=auto sends MD5s here (the SDK signs
    UNSIGNED-PAYLOAD over https), so each part's ETag is checked and the object's ETag is
    the MD5 of the parts' MD5s."""
    with S3Server(tls=True) as tls:
        n = s3_node(nodes, tls, prefix, part_size=5 * MiB)
        rnd = random.Random(7)
        want = {"ckpt/model.bin": rnd.randbytes(6 * MiB + 11), "ckpt/rng.pt": rnd.randbytes(999)}
        (n.mnt / "ckpt").mkdir()
        for rel, data in want.items():
            (n.mnt / rel).write_bytes(data)
        n.flush()
        assert bucket_files(tls, prefix) == want
        big = want["ckpt/model.bin"]
        parts = [big[:5 * MiB], big[5 * MiB:]]
        etag = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest() + "-2"
        st = tls.client().stat_object(tls.bucket, f"{prefix}/ckpt/model.bin")
        assert st.etag.strip('"') == etag
        assert tls.open_uploads(prefix=prefix + "/") == []
        assert n.status()["last_error"] in (None, "")
        n.stop()


@pytest.mark.parametrize("how", ["rename", "rename-out", "reclose"])
def test_barrier_covers_what_moves_while_it_waits(how, srv, prefix, nodes):
    """flush --wait covers a file closed before it even when, while the barrier waits and
    the file is still uploading, it is renamed (also out of the flushed directory) or closed
    again: its entry is cancelled and another carries its bytes on -- the barrier waits for
    that one (it used to return 0 with the bytes in the under-storage under no name)."""
    n = s3_node(nodes, srv, prefix, part_size=5 * MiB, flush_delay=60)  # only flush starts it
    (n.mnt / "ck").mkdir()
    data = random.Random(5).randbytes(12 * MiB)
    (n.mnt / "ck" / "a.bin").write_bytes(data)
    srv.throttle = 2 * MiB               # ~6 s to upload: still staging when it moves
    try:
        up0 = srv.bytes_up
        flush = subprocess.Popen([*ACACHE, "flush", "--wait", "--timeout", "120", str(n.mnt / "ck")],
                                 env=n.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while srv.bytes_up - up0 < MiB:      # the barrier took its entries and hurried them
            assert time.monotonic() < deadline and flush.poll() is None, "the upload did not start"
            time.sleep(0.05)
        if how == "rename":
            os.rename(n.mnt / "ck" / "a.bin", n.mnt / "ck" / "b.bin")
            want = {"ck/b.bin": data}
        elif how == "rename-out":
            os.rename(n.mnt / "ck" / "a.bin", n.mnt / "b.bin")
            want = {"b.bin": data}
        else:
            with open(n.mnt / "ck" / "a.bin", "ab") as f:
                f.write(b"tail")
            # what was closed before the barrier, or the newer content that includes it
            want = {"ck/a.bin": data}
            newer = {"ck/a.bin": data + b"tail"}
        out, err = flush.communicate(timeout=150)
    finally:
        srv.throttle = None
    assert flush.returncode == 0, out + err
    got = bucket_files(srv, prefix)
    assert got == want or (how == "reclose" and got == newer), \
        f"flush --wait returned before the bytes closed before it landed: {sorted(got)}"
