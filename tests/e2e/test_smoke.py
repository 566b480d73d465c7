def test_write_close_flush_lands(node):
    (node.mnt / "a").mkdir()
    (node.mnt / "a" / "x.bin").write_bytes(b"x" * 100_000)
    node.flush()
    assert node.ufs_files() == {"a/x.bin": b"x" * 100_000}


def test_engine_mode_reaches_the_daemon(node, engine):
    """The fixtures' engine modes are what the daemon runs: native-nopt is the native
    engine with kernel passthrough off (native uses it where the kernel offers it)."""
    st = node.status()
    assert st["engine"] == engine.removesuffix("-nopt"), st
    if engine != "native":
        assert st["passthrough"] is False, st
