"""The native mount engine: a FUSE server speaking /dev/fuse directly, with kernel
passthrough (Linux >= 6.9), so writes through the mount reach the cache file at disk speed.

    eng = NativeEngine(vfs, "/ckpt", passthrough=True, max_stack_depth=1)
    eng.start(); ...; eng.stop()

Modules: ``proto`` (wire layouts), ``mount`` (mount(2), stale mounts), ``session``
(reader threads, replies, INTERRUPT, error edge), ``ops`` (request handlers),
``passthrough`` (backing ids, per-inode io mode, capability probe), ``engine``.
"""
from acache.fs.native.engine import NativeEngine
from acache.fs.native.mount import clean_stale_mount
from acache.fs.native.passthrough import probe_passthrough, required_stack_depth

__all__ = ["NativeEngine", "probe_passthrough", "required_stack_depth", "clean_stale_mount"]
