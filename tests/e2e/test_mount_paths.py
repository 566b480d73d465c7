"""A mount path is data, never shell text: quotes, spaces and ``$(...)`` in it."""
import os
import uuid


def test_hostile_mount_path_mounts_and_unmounts(make_variant_node):
    marker = f"/tmp/pwned-{uuid.uuid4().hex[:12]}"
    n = make_variant_node(start=False)
    n.mnt = n.root / f"it's a \"$(touch {marker})\" `touch {marker}` mount"
    n.mnt.mkdir(parents=True)
    n.start()
    assert os.path.ismount(n.mnt)
    (n.mnt / "f").write_bytes(b"hello")
    assert (n.mnt / "f").read_bytes() == b"hello"
    n.cli("umount", str(n.mnt))
    assert not os.path.ismount(n.mnt)
    n.cli("mount", str(n.mnt))
    assert (n.mnt / "f").read_bytes() == b"hello"
    n.flush()
    n.cli("down")
    assert not os.path.ismount(n.mnt)
    assert n.ufs_files() == {"f": b"hello"}
    assert not os.path.exists(marker), "a command in the mount path was run"
