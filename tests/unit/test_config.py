import os
import re

import pytest

from acache import config
from acache.errors import ConfigError


def test_defaults_use_home(tmp_path, monkeypatch):
    monkeypatch.setenv("ACACHE_HOME", str(tmp_path))
    s = config.load()
    assert s.cache_path == tmp_path / "cache"
    assert s.ufs_url == f"file://{tmp_path / 'ufs'}"
    assert s.socket_path == tmp_path / "acache.sock"


def test_precedence_file_env_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("ACACHE_HOME", str(tmp_path))
    cfg = tmp_path / "c.toml"
    cfg.write_text('cache_size = "1GiB"\nflush_delay = 3\nengine = "pyfuse3"\n[s3]\nregion = "eu"\n')
    assert config.load(cfg).cache_size == 1 << 30
    monkeypatch.setenv("ACACHE_CACHE_SIZE", "2g")
    s = config.load(cfg)
    assert s.cache_size == 2 << 30 and s.flush_delay == 3 and s.s3 == {"region": "eu"}
    assert config.load(cfg, cache_size="512MiB").cache_size == 512 << 20


@pytest.mark.parametrize("text,where", [
    ("cache_size = \n", "line 1"),
    ("flush_delay = 1\nbogus = 2\n", "line 2"),
    ("[s3]\nendpoint = 'x'\nnope = 1\n", "line 3"),
    ('engine = "turbo"\n', "line 1"),
    ('cache_size = "lots"\n', "line 1"),
    ('flush_delay = 1\npassthrough = "sometimes"\n', "line 2"),
])
def test_malformed_config_names_file_and_line(tmp_path, text, where):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as e:
        config.load(cfg)
    assert str(cfg) in str(e.value) and where in str(e.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="No such file"):
        config.load(tmp_path / "nope.toml")


@pytest.mark.parametrize("text,n", [("10", 10), ("4k", 4096), ("1.5GiB", 3 << 29), ("2 MB", 2 << 20)])
def test_parse_size(text, n):
    assert config.parse_size(text) == n


def test_long_home_gets_a_short_socket_path(tmp_path):
    home = tmp_path / ("x" * 120)
    s = config.load(home=home)
    assert len(str(s.socket_path)) < 100
    assert s.socket_path == config.load(home=home).socket_path   # the CLI and the daemon agree
    assert config.load(home=tmp_path).socket_path == tmp_path / "acache.sock"


def test_s3_env_over_file_credentials_together(tmp_path, monkeypatch):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[s3]\nendpoint = "http://file:1"\nregion = "eu"\n'
                   'access_key = "fa"\nsecret_key = "fs"\nsession_token = "ft"\n')
    monkeypatch.setenv("ACACHE_S3_ENDPOINT", "http://env:2")
    assert config.load(cfg).s3 == {"endpoint": "http://env:2", "region": "eu", "access_key": "fa",
                                   "secret_key": "fs", "session_token": "ft"}
    monkeypatch.setenv("ACACHE_S3_ACCESS_KEY", "ea")
    monkeypatch.setenv("ACACHE_S3_SECRET_KEY", "es")
    assert config.load(cfg).s3 == {"endpoint": "http://env:2", "region": "eu", "access_key": "ea",
                                   "secret_key": "es"}


def test_passthrough_switch(tmp_path, monkeypatch):
    monkeypatch.setenv("ACACHE_HOME", str(tmp_path))
    assert config.load().passthrough is True
    cfg = tmp_path / "c.toml"
    cfg.write_text("passthrough = false\n")
    assert config.load(cfg).passthrough is False
    monkeypatch.setenv("ACACHE_PASSTHROUGH", "on")
    assert config.load(cfg).passthrough is True
    monkeypatch.setenv("ACACHE_PASSTHROUGH", "maybe")
    with pytest.raises(ConfigError, match="ACACHE_PASSTHROUGH.*true or false"):
        config.load(cfg)


# -- values: every bad one is refused with the key, the value and where it came from ----------
@pytest.mark.parametrize("line,why", [
    ("chunk_size = 0", "multiple of 4 KiB"),
    ("chunk_size = 5000", "multiple of 4 KiB"),
    ('chunk_size = "2GiB"', "multiple of 4 KiB"),
    ("cache_size = 1.5", "whole number of bytes"),
    ('cache_size = "0"', "at least 1 MiB"),
    ("cache_size = -5", "negative"),
    ("cache_size = true", "boolean"),
    ("stall_timeout = nan", "finite"),
    ("stall_timeout = 0", "> 0"),
    ('flush_delay = "inf"', "finite"),
    ("flush_delay = -1", ">= 0"),
    ("flush_delay = true", "a number"),
    ("upload_concurrency = 0", "whole number from 1"),
    ("upload_concurrency = 2.5", "whole number from 1"),
    ('log_level = "LOUD"', "DEBUG, INFO, WARNING"),
    ("log_level = 3", "DEBUG, INFO, WARNING"),
    ('passthrough = "sometimes"', "true or false"),
    ('cache_dir = ""', "directory path"),
    ('ufs = "mem://x"', "for tests"),
    ('ufs = "s3://My_Bucket/prefix"', "not a valid bucket name"),
    ('ufs = "s3://ab/prefix"', "not a valid bucket name"),
    ('ufs = "s3://192.168.1.1/p"', "not a valid bucket name"),
    ('ufs = "file://relative/dir"', "file:///absolute/dir"),
    ('ufs = "/plain/dir"', "unsupported under-storage URL"),
])
def test_bad_values_name_key_value_and_file(tmp_path, monkeypatch, line, why):
    monkeypatch.delenv("ACACHE_TEST_ALLOW_MEM_UFS", raising=False)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"engine = \"auto\"\n{line}\n")
    with pytest.raises(ConfigError) as e:
        config.load(cfg)
    msg = str(e.value)
    key = line.split("=")[0].strip()
    assert f"config file {cfg}, line 2: {key} = " in msg and why in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("key,value,why", [
    ("CHUNK_SIZE", "0", "multiple of 4 KiB"),
    ("CACHE_SIZE", "1.5", "whole number of bytes"),
    ("STALL_TIMEOUT", "nan", "finite"),
    ("FLUSH_DELAY", "inf", "finite"),
    ("UPLOAD_CONCURRENCY", "many", "a number"),
    ("LOG_LEVEL", "chatty", "DEBUG"),
    ("UFS", "mem://x", "for tests"),
])
def test_bad_env_values_name_the_variable(tmp_path, monkeypatch, key, value, why):
    monkeypatch.delenv("ACACHE_TEST_ALLOW_MEM_UFS", raising=False)
    monkeypatch.setenv("ACACHE_HOME", str(tmp_path))
    monkeypatch.setenv(f"ACACHE_{key}", value)
    with pytest.raises(ConfigError) as e:
        config.load()
    assert f"environment ACACHE_{key}: {key.lower()} = {value!r}" in str(e.value), str(e.value)
    assert why in str(e.value)


def test_bad_flag_value_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"--cache-size: cache_size = '1\.5': .*whole number"):
        config.load(home=tmp_path, cache_size="1.5")


def test_good_values(tmp_path, monkeypatch):
    monkeypatch.setenv("ACACHE_HOME", str(tmp_path))
    cfg = tmp_path / "c.toml"
    cfg.write_text('chunk_size = "64KiB"\ncache_size = "auto"\nlog_level = "debug"\n'
                   'flush_delay = 0\nstall_timeout = 2.5\nupload_concurrency = 16\n'
                   'ufs = "s3://my-bucket.v2/some/prefix"\n')
    s = config.load(cfg)
    assert (s.chunk_size, s.cache_size, s.log_level) == (64 << 10, None, "DEBUG")
    assert (s.flush_delay, s.stall_timeout, s.upload_concurrency) == (0.0, 2.5, 16)
    assert s.source("chunk_size") == f"config file {cfg}, line 1" and s.source("engine") == "default"
    monkeypatch.setenv("ACACHE_TEST_ALLOW_MEM_UFS", "1")        # the test-only volatile store
    assert config.load(ufs="mem://t").ufs == "mem://t"


def test_cache_smaller_than_a_chunk(tmp_path):
    with pytest.raises(ConfigError, match=r"cache_size = 2097152 \(--cache-size\) is smaller than "
                                          r"chunk_size = 4194304 \(--chunk-size\)"):
        config.load(home=tmp_path, cache_size="2MiB", chunk_size="4MiB")


@pytest.mark.parametrize("data", [b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", b"chunk_size = 1\x00\n"])
def test_binary_config_file_names_the_file(tmp_path, data):
    cfg = tmp_path / "c.toml"
    cfg.write_bytes(data)
    with pytest.raises(ConfigError) as e:
        config.load(cfg)
    assert str(e.value).startswith(f"config file {cfg}: "), str(e.value)


def test_cache_size_larger_than_the_disk_warns(tmp_path):
    st = os.statvfs(tmp_path)
    disk = st.f_blocks * st.f_frsize
    s = config.load(home=tmp_path, cache_size=str(disk + (1 << 30)))
    (w,) = config.startup_warnings(s)
    assert f"cache_size = {disk + (1 << 30)} (--cache-size) is larger than" in w, w
    assert config.startup_warnings(config.load(home=tmp_path, cache_size=str(disk // 4))) == []


# -- layout: state dir, cache dir, file:// under-storage and mount point never overlap -------
R = "/r"
LAYOUTS = [
    # (cache_dir, ufs dir, mount point, refused because ... | None)
    (None, None, None, None),                                  # all default: <home>/cache, <home>/ufs
    (None, None, "/r/mnt", None),
    ("/r/c", "/r/u", "/r/m", None),                            # siblings
    ("/r/home/c2", "/r/home/u2", "/r/m", None),                # cache and ufs inside the state dir
    ("/r/c", "/r/c/u", None, "under-storage /r/c/u .* inside the cache directory"),
    ("/r/u/c", "/r/u", None, "cache directory /r/u/c .* inside the under-storage"),
    ("/r/c", "/r/c", None, "cache directory .* under-storage .* same directory"),
    ("/r/x", "/r", None, "state directory /r/home .* inside the under-storage"),
    ("/r/x", "/r/home", None, "state directory .* under-storage .* same directory"),
    ("/r/home", "/r/u", None, "state directory .* cache directory .* same directory"),
    ("/r", "/r/u", None, "state directory /r/home .* inside the cache directory"),
    ("/r/c", "/r/u", "/r/u/inner", "mount point /r/u/inner .* inside the under-storage"),
    ("/r/c", "/r/u", "/r/u", "under-storage .* mount point .* same directory"),
    ("/r/c", "/r/m/u", "/r/m", "under-storage /r/m/u .* inside the mount point"),
    ("/r/c", "/r/u", "/r/home/m", "mount point /r/home/m .* inside the state directory"),
    ("/r/c", "/r/u", "/r/c/m", "mount point /r/c/m .* inside the cache directory"),
    ("/r/m/c", "/r/u", "/r/m", "cache directory /r/m/c .* inside the mount point"),
    ("/r/c", "/r/u", "/r", "inside the mount point /r"),
    (None, None, "/r/home/ufs/m", "mount point /r/home/ufs/m .* inside the"),
]


@pytest.mark.parametrize("cache,ufs,mnt,refused", LAYOUTS)
def test_layout_overlaps(tmp_path, cache, ufs, mnt, refused):
    def real(p):
        return str(tmp_path) + p if p else None
    s = config.load(home=tmp_path / "r" / "home", cache_dir=real(cache),
                    ufs=f"file://{real(ufs)}" if ufs else None)
    if refused is None:
        config.check_layout(s, real(mnt))
        return
    with pytest.raises(ConfigError) as e:
        config.check_layout(s, real(mnt))
    msg = str(e.value).replace(str(tmp_path), "")
    assert re.search(refused, msg), msg
    assert "must not overlap" in msg


def test_layout_resolves_symlinks(tmp_path):
    (tmp_path / "u" / "inner").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "u")
    s = config.load(home=tmp_path / "home", ufs=f"file://{tmp_path / 'u'}")
    with pytest.raises(ConfigError, match="mount point .*/u/inner .*inside the under-storage"):
        config.check_layout(s, str(tmp_path / "link" / "inner"))
    s = config.load(home=tmp_path / "home", ufs=f"file://{tmp_path / 'link'}",
                    cache_dir=tmp_path / "u" / "cache")
    with pytest.raises(ConfigError, match="inside the under-storage"):
        config.check_layout(s)


def test_layout_s3_has_no_directory(tmp_path):
    s = config.load(home=tmp_path / "home", ufs="s3://bucket/p")
    config.check_layout(s, str(tmp_path / "m"))
    with pytest.raises(ConfigError, match="mount point .* inside the state directory"):
        config.check_layout(s, str(tmp_path / "home" / "m"))
