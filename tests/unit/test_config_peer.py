"""The peer keys of the settings: listen, advertise, secret_file (acache.net.auth)."""
import os

import pytest

from acache import config
from acache.errors import ConfigError


def _secret(tmp_path, mode=0o600, data=b"0123456789abcdef0123456789abcdef\n"):
    p = tmp_path / "secret"
    p.write_bytes(data)
    os.chmod(p, mode)
    return p


def test_loopback_needs_no_secret(tmp_path):
    s = config.load(home=str(tmp_path), listen="127.0.0.1:7470")
    assert s.listen == "127.0.0.1:7470" and s.secret_file is None


def test_non_loopback_without_secret_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ACACHE_LISTEN", "0.0.0.0:7470")
    with pytest.raises(ConfigError, match=r"listen = '0.0.0.0:7470' \(environment ACACHE_LISTEN\).*secret_file"):
        config.load(home=str(tmp_path))
    with pytest.raises(ConfigError, match="advertise"):
        config.load(home=str(tmp_path), listen="127.0.0.1:1", advertise="10.1.2.3:7470")


def test_secret_file_accepted_and_refused(tmp_path):
    good = _secret(tmp_path)
    s = config.load(home=str(tmp_path), listen="0.0.0.0:7470", advertise="10.0.0.5:7470",
                    secret_file=str(good))
    assert s.secret_file == good
    os.chmod(good, 0o640)
    with pytest.raises(ConfigError, match=r"--secret-file: secret_file = .*: mode 0640 lets others read"):
        config.load(home=str(tmp_path), secret_file=str(good))
    short = _secret(tmp_path, data=b"short")
    with pytest.raises(ConfigError, match="at least 16"):
        config.load(home=str(tmp_path), secret_file=str(short))
    with pytest.raises(ConfigError, match="No such file"):
        config.load(home=str(tmp_path), secret_file=str(tmp_path / "missing"))


@pytest.mark.parametrize("key,value,why", [
    ("listen", "7470", "expected host:port"),
    ("listen", "h:99999", "expected 0 to 65535"),
    ("listen", "::1:7470", "needs brackets"),
    ("advertise", "10.0.0.1:0", "peers must be able to dial it"),
    ("advertise", "0.0.0.0:7470", "peers must be able to dial it"),
])
def test_bad_addresses_one_line(tmp_path, key, value, why):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'{key} = "{value}"\n')
    with pytest.raises(ConfigError, match=why) as e:
        config.load(cfg, home=str(tmp_path))
    assert f"line 1: {key} = " in str(e.value) and "\n" not in str(e.value)


def test_ipv6_loopback(tmp_path):
    assert config.load(home=str(tmp_path), listen="[::1]:0").listen == "[::1]:0"


def test_transport_from_settings(tmp_path):
    from acache.net.tcp import TcpTransport
    s = config.load(home=str(tmp_path), listen="0.0.0.0:0", secret_file=str(_secret(tmp_path)))
    t = TcpTransport.from_settings(s)
    assert t.secret == b"0123456789abcdef0123456789abcdef"
    assert TcpTransport.from_settings(config.load(home=str(tmp_path))).secret is None
