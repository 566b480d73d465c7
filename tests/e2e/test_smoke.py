def test_write_close_flush_lands(node):
    (node.mnt / "a").mkdir()
    (node.mnt / "a" / "x.bin").write_bytes(b"x" * 100_000)
    node.flush()
    assert node.ufs_files() == {"a/x.bin": b"x" * 100_000}
