"""The native mount engine: a FUSE server speaking /dev/fuse directly, with kernel
passthrough (Linux >= 6.9), so writes through the mount reach the cache file at disk speed.

    ok, why = probe_passthrough(cache_dir)
    eng = NativeEngine(vfs, "/ckpt", passthrough=ok,
                       max_stack_depth=required_stack_depth(cache_dir))
    eng.start(); ...; eng.stop()          # or eng.wait() until unmounted from outside

Modules: ``proto`` (wire layouts, INIT negotiation), ``mount`` (mount(2), stale mounts),
``session`` (reader threads, replies, INTERRUPT, the error edge), ``ops`` (request
handlers), ``passthrough`` (backing ids, per-inode io mode, capability probe), ``engine``;
``selfbench`` is a quick fio sanity check (``python -m acache.fs.native.selfbench``).

Kernel facts this engine is built around (seen on 6.18, protocol 7.45):

- passthrough and the writeback cache exclude each other: ask for both and passthrough is
  silently off (BACKING_OPEN then fails with EPERM);
- a passthrough open must not carry FOPEN_KEEP_CACHE (the open fails with EIO);
- one backing file per inode while it has passthrough opens; while it does, every open
  must be passthrough, and while it has daemon-served opens, none may be (EIO otherwise);
- BACKING_OPEN needs CAP_SYS_ADMIN and max_stack_depth above the backing file system's;
- under passthrough the daemon sees no READ/WRITE (mmap stores included): the close of a
  write handle (FLUSH, synchronous with close(2)) is the event that orders persistence;
- without HANDLE_KILLPRIV_V2 the kernel asks GETXATTR(security.capability) before every
  write, one daemon round trip per write even under passthrough;
- fstat() sends GETATTR without the handle; GETATTR_FH comes only from file paths such
  as lseek(SEEK_END), so the VFS must answer by inode for files open for writing;
- answering FSYNC (or FLUSH, FALLOCATE...) with ENOSYS disables it for the whole mount.
"""
from acache.fs.native.engine import NativeEngine
from acache.fs.native.mount import clean_stale_mount
from acache.fs.native.passthrough import can_mount_natively, probe_passthrough, required_stack_depth

__all__ = ["NativeEngine", "can_mount_natively", "probe_passthrough", "required_stack_depth",
           "clean_stale_mount"]
