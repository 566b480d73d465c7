"""`acache mount ~/ckpt` as a normal user: the pyfuse3 engine through fusermount3, with
the reason it was chosen; a file written through the mount reads back and is persisted."""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.acache_node import fuse_mounts

USER = "nobody"
ROOT = Path(__file__).resolve().parents[2]


def _user_can_run(uid: int, gid: int, path: str) -> bool:
    p = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                        "sh", "-c", f"exec '{path}' -c pass"], capture_output=True, cwd="/")
    return p.returncode == 0


def test_nonroot_mount_with_pyfuse3(tmp_path):
    if os.geteuid() != 0 or not shutil.which("fusermount3") or not shutil.which("setpriv"):
        pytest.fail("needs root (to become another user), fusermount3 and setpriv")
    pw = pwd.getpwnam(USER)
    base = Path(tempfile.mkdtemp(prefix="acache-nonroot-", dir="/tmp"))
    home = base / "home"
    home.mkdir()
    (home / "ckpt").mkdir()
    os.chown(home, pw.pw_uid, pw.pw_gid)
    os.chown(home / "ckpt", pw.pw_uid, pw.pw_gid)
    os.chmod(base, 0o755)
    py = sys.executable
    script = f"""set -e
export HOME={home} PYTHONPATH={ROOT}
unset ACACHE_HOME ACACHE_ENGINE ACACHE_UFS
cd "$HOME"
grep CapEff /proc/self/status
{py} -m acache.cli mount "$HOME/ckpt"
echo "written by $(id -un)" > "$HOME/ckpt/f.txt"
cat "$HOME/ckpt/f.txt"
stat -c %U "$HOME/ckpt/f.txt"
{py} -m acache.cli flush --wait --timeout 60
{py} -m acache.cli umount "$HOME/ckpt"
{py} -m acache.cli down
"""
    as_user = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups",
               "sh", "-c", script]
    # The test runs in a scratch mount namespace set up as a stock distribution is: /dev/fuse
    # is 0666 there (udev), in some containers 0600 (libfuse then fails before it would try
    # fusermount3): a 0666 node of the same device is bound over it.  And where this
    # interpreter lives out of the user's reach (a pyenv under a 0700 /root), /root becomes
    # an empty 0755 tmpfs with only the interpreter's tree bound back in.  The user and
    # what it may do are unchanged (no capabilities: checked below).
    wrap = "set -e; "
    st = os.stat("/dev/fuse")
    if st.st_mode & 0o666 != 0o666:
        node = base / "fuse"
        os.mknod(node, 0o20666, st.st_rdev)
        os.chmod(node, 0o666)
        wrap += f"mount --bind {node} /dev/fuse; "
    if not _user_can_run(pw.pw_uid, pw.pw_gid, py):
        real = os.path.realpath(py)
        top = real.split("/")[:3]              # ['', 'root', '.pyenv']
        if top[1] != "root":
            pytest.fail(f"{USER} cannot run {py} ({real})")
        keep = base / "keep"
        keep.mkdir()
        sub = "/".join(top)
        wrap += (f"mount --bind {sub} {keep}; mount -t tmpfs -o mode=0755 tmpfs /root; "
                 f"mkdir -p {sub}; mount --move {keep} {sub}; ")
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", wrap + 'exec "$@"', "sh", *as_user]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                           env={k: v for k, v in os.environ.items() if not k.startswith("ACACHE_")})
        log = home / ".local/state/acache/acache.log"
        assert p.returncode == 0, f"{p.stdout}\n{p.stderr}\n{log.read_text() if log.exists() else ''}"
        lines = p.stdout.splitlines()
        said = [ln for ln in lines if ln.startswith("mounted ")]
        assert said and "pyfuse3 engine" in said[0] and "CAP_SYS_ADMIN" in said[0], p.stdout
        assert f"written by {USER}" in lines and USER in lines, p.stdout
        assert "CapEff:\t0000000000000000" in lines, p.stdout      # no privilege at all
        assert (home / ".local/state/acache/ufs/f.txt").read_text() == f"written by {USER}\n"
        assert str(home / "ckpt") not in fuse_mounts()
    finally:
        sock = home / ".local/state/acache/acache.sock"
        if sock.exists():       # a failed run: stop what it left, as root
            from tests.acache_node import AcacheNode
            n = AcacheNode(base / "teardown")
            n.home = home / ".local/state/acache"
            n.mnt = home / "ckpt"
            n.env["ACACHE_HOME"] = str(n.home)
            n.kill9(must=False)
        if str(home / "ckpt") in fuse_mounts():
            subprocess.run(["umount", "-l", str(home / "ckpt")], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
