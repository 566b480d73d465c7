"""UnderStore conformance: symbolic links, attributes, hostile listings, never following links.

Runs against every store kind (``backend`` fixture: file, mem, s3 on moto)."""
from __future__ import annotations

import logging
import os
import stat

import pytest

from acache.data.under.base import Attrs
from acache.errors import PermanentError

A = Attrs(mode=0o640, uid=1234, gid=5678, mtime_ns=1_700_000_000_123_456_789)


def names(store, path=""):
    return {e.name: e for e in store.list_dir(path)}


def test_symlink_round_trip(backend, store):
    store.mkdir("checkpoint-3")
    store.symlink("latest", "checkpoint-3", A)
    store.symlink("d/tok", "../shared/tokenizer.json")     # parents are made
    ls = names(store)
    assert ls["latest"].link == "checkpoint-3" and not ls["latest"].is_dir
    assert ls["latest"].size == len("checkpoint-3")
    assert (ls["latest"].uid, ls["latest"].gid, ls["latest"].mtime_ns) == (1234, 5678, A.mtime_ns)
    assert ls["checkpoint-3"].is_dir and ls["checkpoint-3"].link is None
    assert names(store, "d")["tok"].link == "../shared/tokenizer.json"
    assert store.stat("latest").link == "checkpoint-3"
    # idempotent, and a link replaces a link
    store.symlink("latest", "checkpoint-3", A)
    store.symlink("latest", "checkpoint-4", A)
    assert names(store)["latest"].link == "checkpoint-4"
    # renamed and deleted as themselves, never as what they point to
    store.rename("latest", "newest")
    assert "latest" not in names(store) and names(store)["newest"].link == "checkpoint-4"
    assert names(backend.open())["newest"].link == "checkpoint-4"    # a restart sees it
    store.delete("newest")
    assert "newest" not in names(store) and names(store)["checkpoint-3"].is_dir
    assert backend.leftovers() == []


def test_links_and_files_replace_each_other(backend, store):
    backend.put(store, "f", b"file")
    store.symlink("l", "target")
    store.rename("l", "f")                  # a link renamed onto a file replaces it
    assert {n: e.link for n, e in names(store).items()} == {"f": "target"}
    backend.put(store, "g", b"data")
    store.rename("g", "f")                  # and a file renamed onto a link
    assert {n: e.link for n, e in names(store).items()} == {"f": None}
    assert store.read("f", 0, 10) == b"data"
    store.symlink("f", "t2")                # a link made where a file is
    assert {n: e.link for n, e in names(store).items()} == {"f": "t2"}


def test_attrs_land_with_stage_mkdir_and_set_attrs(backend, store):
    data = b"x" * 1000
    st = store.stage("ck/w", store.new_token("ck/w"), backend.src(data), len(data), attrs=A)
    st.commit()
    e = names(store, "ck")["w"]
    assert (e.mode, e.uid, e.gid, e.mtime_ns, e.size) == (0o640, 1234, 5678, A.mtime_ns, 1000)
    store.mkdir("ck2", Attrs(0o700, 1, 2, 1_600_000_000_000_000_000))
    d = names(store)["ck2"]
    assert d.is_dir and (d.mode, d.uid, d.gid) == (0o700, 1, 2)
    store.set_attrs("ck/w", Attrs(0o600, 4, 5, 1_500_000_000_000_000_007))
    e = names(store, "ck")["w"]
    assert (e.mode, e.uid, e.gid, e.mtime_ns) == (0o600, 4, 5, 1_500_000_000_000_000_007)
    assert store.read("ck/w", 0, 2000) == data                  # the data is untouched
    store.set_attrs("ck/w", Attrs(0o600, 4, 5, 1_500_000_000_000_000_007))  # idempotent
    store.set_attrs("no/such", A)                               # gone: nothing to change
    store.rename("ck/w", "ck/v")
    e = names(store, "ck")["v"]
    assert (e.mode, e.uid, e.mtime_ns) == (0o600, 4, 1_500_000_000_000_000_007)


def test_unknown_attrs_are_reported_unknown(backend, store):
    backend.raw_put("other/x", b"by another tool")
    e = names(store, "other")["x"]
    if backend.kind == "file":      # a POSIX directory always has them: the file's own
        st = os.stat(os.path.join(backend.root, "other", "x"))
        assert (e.mode, e.uid, e.gid, e.mtime_ns) == \
            (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns)
    else:
        assert (e.mode, e.uid, e.gid, e.mtime_ns) == (0, -1, -1, 0) and e.mtime > 0


# -- file:// never follows links ----------------------------------------------------------

@pytest.fixture(params=["openat2", "walk"])
def planted(tmp_path, request, monkeypatch):
    """A file:// root with links planted by someone else: to a 0600 file in a 0700
    directory outside, and to a root-only directory outside.  Paths are resolved by
    openat2, or by the walk of O_NOFOLLOW descriptors used where the kernel lacks it."""
    from acache.data.under import file as filestore
    from acache.data.under.file import FileStore
    monkeypatch.setattr(filestore, "_openat2_works", [request.param == "openat2"])
    outside = tmp_path / "outside"
    (outside / "private").mkdir(parents=True)
    os.chmod(outside / "private", 0o700)
    (outside / "private" / "secret").write_bytes(b"secret")
    os.chmod(outside / "private" / "secret", 0o600)
    (outside / "rootonly").mkdir()
    os.chmod(outside / "rootonly", 0o700)
    root = tmp_path / "under"
    (root / "ok").mkdir(parents=True)
    os.symlink(outside / "private" / "secret", root / "secret")
    os.symlink(outside / "rootonly", root / "dirlink")
    os.symlink("../outside/rootonly", root / "ok" / "rel")
    return FileStore(f"file://{root}"), root, outside


def test_file_store_lists_planted_links_as_links(planted):
    store, root, outside = planted
    ls = names(store)
    assert ls["secret"].link == str(outside / "private" / "secret") and ls["secret"].size != 6
    assert ls["dirlink"].link == str(outside / "rootonly") and not ls["dirlink"].is_dir
    assert names(store, "ok")["rel"].link == "../outside/rootonly"
    assert store.stat("secret").link is not None


def test_file_store_never_reads_or_writes_through_links(planted, tmp_path):
    store, root, outside = planted
    store.mkdir("m")
    with pytest.raises(PermanentError):
        store.read("secret", 0, 100)
    for path in ("dirlink/x", "ok/rel/x"):
        with pytest.raises(PermanentError, match="symbolic link"):
            store.stage(path, store.new_token(path), _src(tmp_path), 4).commit()
        with pytest.raises(PermanentError, match="symbolic link"):
            store.mkdir(path)
        with pytest.raises(PermanentError, match="symbolic link"):
            store.symlink(path, "t")
        with pytest.raises(PermanentError, match="symbolic link"):
            store.list_dir(path.rpartition("/")[0])
        with pytest.raises(PermanentError, match="symbolic link"):
            store.rename("m", path)
        with pytest.raises(PermanentError, match="symbolic link"):
            store.stat(path)
    store.set_attrs("secret", Attrs(0o666, 0, 0, 1))    # changes the link, never the target
    assert stat.S_IMODE(os.stat(outside / "private" / "secret").st_mode) == 0o600
    store.delete("dirlink")                              # removes the link, not the target
    assert os.path.isdir(outside / "rootonly") and not os.path.lexists(root / "dirlink")
    assert os.listdir(outside / "rootonly") == []


def _src(tmp_path) -> str:
    p = tmp_path / "src"
    p.write_bytes(b"evil")
    return str(p)


def test_file_store_skips_fifos_and_never_blocks_on_them(planted):
    store, root, _ = planted
    os.mkfifo(root / "fifo")
    assert "fifo" not in names(store) and store.stat("fifo") is None
    with pytest.raises(PermanentError):
        store.read("fifo", 0, 10)


# -- hostile names ----------------------------------------------------------------------

def _raw_put(b, path: str) -> None:
    """PUT a key that SDKs refuse or normalize ('.' and '..' segments), as another tool could."""
    from urllib.parse import quote

    import urllib3
    key = "/".join("%2E" * len(p) if p in (".", "..") else quote(p)
                   for p in f"{b.prefix}/{path}".split("/"))
    r = urllib3.PoolManager().request("PUT", f"{b.s3.endpoint}/{b.s3.bucket}/{key}", body=b"x")
    assert r.status == 200, r.data


def test_s3_listing_skips_keys_that_cannot_be_names(s3backend, caplog):
    store = s3backend.open()
    for key in ("ok/../../escape", "ok/./dot", "ok//empty", "ok/" + "n" * 300, "ok/fine",
                "ok/../x.rclonelink"):
        _raw_put(s3backend, key)
    assert len([k for k in s3backend.raw_keys() if "/../" in k]) == 2
    with caplog.at_level(logging.WARNING):
        ls = names(store, "ok")
        top = names(store)
    assert set(ls) == {"fine"}
    assert set(top) == {"ok"}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) >= 4 and all("skipping" in w for w in warned)


def test_s3_put_of_a_path_the_sdk_refuses_names_it(s3backend):
    store = s3backend.open()
    path = "d/" + "n" * 1100          # longer than an S3 key may be
    with pytest.raises(PermanentError, match="n" * 20):
        data = b"x"
        store.stage(path, store.new_token(path), s3backend.src(data), 1).commit()


def test_bad_name_tells_what_cannot_be_shown():
    from acache.data.under.base import bad_name
    for name in ("", ".", "..", "a/b", "a\0b", "n" * 256, "é" * 128):
        assert bad_name(name) is not None, name
    for name in ("...", ".hidden", "n" * 255, "é" * 127, "x.rclonelink", "\udcff"):
        assert bad_name(name) is None, name
