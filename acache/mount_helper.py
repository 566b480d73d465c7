"""mount.fuse.acache: the helper mount(8) runs for an /etc/fstab line of type fuse.acache.

    acache  /ckpt  fuse.acache  defaults,_netdev,home=/var/lib/acache  0 0

mount(8) runs ``mount.fuse.acache SOURCE MOUNTPOINT -o OPTIONS``.  SOURCE is ``acache``
(any word: the settings of the node's config say what is mounted) or an under-storage URL (``s3://bucket/prefix``,
``file:///dir``).  Options: ``home``, ``config``, ``engine``, ``ufs``, ``cache_dir``,
``cache_size``, ``upload_limit``, ``metrics``, ``passthrough``, ``flush_delay``,
``log_level`` (``-`` or ``_``), given to acache as its ACACHE_* settings; mount(8)'s own
(``defaults``, ``_netdev``, ``rw``, ``auto``/``noauto``, ``nofail``, ``x-systemd.*``...)
are ignored.  It returns once the mount is up (`acache mount`, which starts the node if
none runs), with acache's exit status and one-line error otherwise.
"""
from __future__ import annotations

import os
import subprocess
import sys

# options that become ACACHE_<NAME> settings of the node / the mount
SETTINGS = {"home", "config", "engine", "ufs", "cache_dir", "cache_size", "upload_limit", "metrics",
            "passthrough", "flush_delay", "stall_timeout", "log_level", "chunk_size",
            "upload_concurrency", "meta_reserve"}
# mount(8)'s generic options, meaningless (or always true) here
IGNORED = {"defaults", "_netdev", "rw", "auto", "noauto", "nofail", "user", "nouser", "users",
           "owner", "group", "suid", "nosuid", "dev", "nodev", "exec", "noexec", "async",
           "atime", "noatime", "relatime", "norelatime", "strictatime", "nodiratime", "lazytime",
           "nolazytime", "nosymfollow", "silent", "loud"}
IGNORED_PREFIXES = ("x-", "comment=", "_")
USAGE = "usage: mount.fuse.acache SOURCE MOUNTPOINT [-o OPTIONS] [-n] [-s] [-v] [-f]"


class HelperError(Exception):
    pass


def parse(argv: list[str]) -> tuple[str, str, dict[str, str], bool]:
    """-> (source, mountpoint, {ACACHE_* variable: value}, fake)."""
    pos: list[str] = []
    opts: list[str] = []
    fake = False
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-o":
            if i + 1 >= len(argv):
                raise HelperError(f"-o needs a value; {USAGE}")
            opts += [o for o in argv[i + 1].split(",") if o]
            i += 2
            continue
        if a.startswith("-o") and len(a) > 2:
            opts += [o for o in a[2:].split(",") if o]
        elif a == "-f":
            fake = True
        elif a in ("-n", "-s", "-v"):
            pass      # no mtab / sloppy / verbose: nothing to do differently
        elif a == "-t" and i + 1 < len(argv):
            i += 1    # the type, which we are
        elif a.startswith("-"):
            raise HelperError(f"unknown argument {a!r}; {USAGE}")
        else:
            pos.append(a)
        i += 1
    if len(pos) != 2:
        raise HelperError(USAGE)
    source, mountpoint = pos
    env: dict[str, str] = {}
    if "://" in source:
        env["ACACHE_UFS"] = source
    # anything else is a label ("acache"; mount(8) makes it a path when the working
    # directory happens to hold a file of that name): the settings say what is mounted
    for o in opts:
        name, eq, value = o.partition("=")
        key = name.replace("-", "_")
        if key in SETTINGS:
            if not eq or not value:
                raise HelperError(f"option {name!r} needs a value ({name}=...)")
            env[f"ACACHE_{key.upper()}"] = value
        elif o == "ro":
            raise HelperError("option 'ro': an acache mount is read-write (a read-only view "
                              "of the under-storage is not supported)")
        elif o in IGNORED or o.startswith(IGNORED_PREFIXES):
            continue
        else:
            raise HelperError(f"unknown option {o!r} (acache options: "
                              f"{', '.join(sorted(SETTINGS))}; mount(8)'s generic ones are ignored)")
    return source, mountpoint, env, fake


def main(argv: list[str] | None = None) -> int:
    try:
        source, mountpoint, env, fake = parse(sys.argv[1:] if argv is None else argv)
    except HelperError as e:
        print(f"mount.fuse.acache: {e}", file=sys.stderr, flush=True)
        return 1
    if fake:
        return 0
    full = dict(os.environ, **env)
    if "HOME" not in full:     # mount(8) at boot: the default state dir is ~/.local/state/acache
        import pwd
        full["HOME"] = pwd.getpwuid(os.geteuid()).pw_dir
    p = subprocess.run([sys.executable, "-m", "acache.cli", "mount", mountpoint], env=full,
                       stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        return p.returncode
    if not os.path.ismount(mountpoint):   # mounted by a node of another mount namespace
        print(f"mount.fuse.acache: the running node mounted {mountpoint}, but not where this "
              "mount(8) can see it (the node runs in another mount namespace); `acache down` "
              "it, or mount from its namespace", file=sys.stderr, flush=True)
        return 32
    return 0


def script_text(python: str = sys.executable) -> str:
    """The /sbin/mount.fuse.acache that `acache install-helper` writes: this Python, this
    acache (its directory first on PYTHONPATH)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return ("#!/bin/sh\n# mount(8) helper for fstab lines of type fuse.acache (written by "
            "`acache install-helper`)\n"
            f"PYTHONPATH='{root}'${{PYTHONPATH:+:$PYTHONPATH}} exec '{python}' -m acache.mount_helper \"$@\"\n")


if __name__ == "__main__":
    sys.exit(main())
