"""Fixtures for the UnderStore conformance suite: one ``backend`` per store kind.

A Backend opens fresh store instances over the *same* storage (what a restart
sees), writes behind the store's back (another tool), and lists what a stage
may leave behind (temp files, staged bytes, open multipart uploads).
"""
from __future__ import annotations

import os
import uuid

import pytest

from acache.data.under.file import TMP_PREFIX, FileStore
from acache.data.under.mem import MemState, MemStore
from acache.data.under.s3 import S3Store
from tests.s3server import S3Server

KINDS = ["file", "mem", "s3"]


class Backend:
    def __init__(self, kind: str, tmp_path, s3: S3Server | None):
        self.kind = kind
        self.tmp = tmp_path
        self.s3 = s3
        self.root = str(tmp_path / "under")
        self.mem_state = MemState()
        self.prefix = f"t-{uuid.uuid4().hex[:12]}"
        self._open: list = []

    def open(self, **opts):
        """A new store instance over this backend's storage."""
        if self.kind == "file":
            st = FileStore(f"file://{self.root}")
        elif self.kind == "mem":
            st = MemStore("mem://conformance", state=self.mem_state)
        else:
            st = S3Store(self.s3.url(self.prefix), **self.s3.options(**opts))
        self._open.append(st)
        return st

    def close(self) -> None:
        for st in self._open:
            st.close()

    def src(self, data: bytes) -> str:
        """A local file holding ``data`` (the cache file a stage reads)."""
        p = self.tmp / f"src-{uuid.uuid4().hex}"
        p.write_bytes(data)
        return str(p)

    def put(self, store, path: str, data: bytes) -> None:
        """Stage and commit ``data`` at ``path`` through the store."""
        token = store.new_token(path)
        store.stage(path, token, self.src(data), len(data)).commit()

    def raw_put(self, path: str, data: bytes) -> None:
        """Write ``path`` behind the store's back (another tool).  A trailing '/'
        on s3 writes a directory marker object."""
        if self.kind == "file":
            full = os.path.join(self.root, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as f:
                f.write(data)
        elif self.kind == "mem":
            import time
            with self.mem_state.lock:
                self.mem_state.files[path] = (data, time.time())
        else:
            import io
            self.s3.client().put_object(self.s3.bucket, f"{self.prefix}/{path}",
                                        io.BytesIO(data), len(data))

    def leftovers(self) -> list:
        """Whatever staging left behind that a user could not see."""
        if self.kind == "file":
            return [os.path.join(d, n) for d, _, names in os.walk(self.root)
                    for n in names if n.startswith(TMP_PREFIX)]
        if self.kind == "mem":
            return list(self.mem_state.staged)
        return self.s3.open_uploads(prefix=self.prefix + "/")

    def raw_keys(self) -> list[str]:
        """Every object key in the bucket (s3 only)."""
        return [o.object_name for o in
                self.s3.client().list_objects(self.s3.bucket, recursive=True)]


@pytest.fixture(scope="session")
def s3server():
    srv = S3Server()
    srv.start()
    yield srv
    srv.kill()


@pytest.fixture(scope="session")
def s3auth():
    """A second moto server that checks credentials."""
    srv = S3Server(auth=True)
    srv.start()
    yield srv
    srv.kill()


@pytest.fixture(params=KINDS)
def backend(request, tmp_path):
    s3 = request.getfixturevalue("s3server") if request.param == "s3" else None
    b = Backend(request.param, tmp_path, s3)
    yield b
    b.close()


@pytest.fixture
def store(backend):
    return backend.open()


@pytest.fixture
def s3backend(tmp_path, s3server):
    b = Backend("s3", tmp_path, s3server)
    yield b
    b.close()
