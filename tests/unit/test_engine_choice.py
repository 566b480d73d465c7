"""Which engine `--engine auto` picks, and that it says why (Node._choose_engine)."""
from __future__ import annotations

import types

import pytest

import acache.fs.native as native
from acache.config import Settings
from acache.errors import ConfigError
from acache.node.daemon import Node


def _choose(monkeypatch, tmp_path, want, *, probe, can_mount, passthrough=True):
    monkeypatch.setattr(native, "probe_passthrough", lambda d: probe)
    monkeypatch.setattr(native, "can_mount_natively", lambda: can_mount)
    monkeypatch.setattr(native, "required_stack_depth", lambda d: 1)
    fake = types.SimpleNamespace(settings=Settings(home=tmp_path, passthrough=passthrough),
                                 cache=types.SimpleNamespace(dir=tmp_path), vfs=None,
                                 backend=types.SimpleNamespace(shared=False))
    name, why, make = Node._choose_engine(fake, want)
    return name, why, make and make(str(tmp_path / "mnt"))


def test_auto_with_passthrough_is_native_passthrough(monkeypatch, tmp_path):
    name, why, eng = _choose(monkeypatch, tmp_path, "auto", probe=(True, "FUSE passthrough available"),
                             can_mount=(True, ""))
    assert name == "native" and eng.passthrough and "available" in why


def test_auto_without_passthrough_is_still_native_when_we_can_mount(monkeypatch, tmp_path):
    name, why, eng = _choose(monkeypatch, tmp_path, "auto", probe=(False, "kernel 6.1 has no FUSE passthrough"),
                             can_mount=(True, ""))
    assert name == "native" and not eng.passthrough
    assert "kernel 6.1" in why and "serves the data itself" in why


def test_passthrough_false_skips_the_probe(monkeypatch, tmp_path):
    name, why, eng = _choose(monkeypatch, tmp_path, "auto", probe=(True, "never asked"),
                             can_mount=(True, ""), passthrough=False)
    assert name == "native" and not eng.passthrough and "passthrough = false" in why


def test_auto_falls_back_to_pyfuse3_without_mount_privileges(monkeypatch, tmp_path):
    name, why, make = _choose(monkeypatch, tmp_path, "auto", probe=(False, "needs CAP_SYS_ADMIN"),
                              can_mount=(False, "mounting FUSE without fusermount3 needs CAP_SYS_ADMIN"))
    assert name == "pyfuse3" and make is None and "fusermount3" in why


def test_explicit_choices(monkeypatch, tmp_path):
    assert _choose(monkeypatch, tmp_path, "pyfuse3", probe=(True, ""), can_mount=(True, ""))[0] == "pyfuse3"
    name, _, eng = _choose(monkeypatch, tmp_path, "native", probe=(False, "no"), can_mount=(False, "no"))
    assert name == "native" and not eng.passthrough
    with pytest.raises(ConfigError, match="unknown engine"):
        _choose(monkeypatch, tmp_path, "turbo", probe=(True, ""), can_mount=(True, ""))
