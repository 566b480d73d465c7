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
