"""A minimal io_uring (ctypes, raw io_uring_setup/io_uring_enter) to keep reads in flight
on a file from the thread that also does other calls on it: io_uring completions then
interrupt that thread's FUSE requests (an INTERRUPT each), as fsx-style checkers and
training data loaders do.  Run as a program, it is the watchdog of
tests/e2e/test_uring_inflight.py: ``python -m tests.uring PATH SECONDS DEPTH`` prints
the calls made, the EINTRs seen and the slowest stat/getxattr/read as JSON."""
import ctypes
import mmap
import os
import struct

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
SYS_SETUP, SYS_ENTER = 425, 426
OP_READ = 22
ENTER_GETEVENTS = 1
OFF_SQ_RING, OFF_CQ_RING, OFF_SQES = 0, 0x8000000, 0x10000000
FEAT_SINGLE_MMAP = 1


class Ring:
    def __init__(self, entries: int = 32) -> None:
        params = ctypes.create_string_buffer(120)
        fd = _libc.syscall(SYS_SETUP, ctypes.c_uint(entries), params)
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"io_uring_setup: {os.strerror(e)}")
        self.fd = fd
        p = params.raw
        sq_entries, cq_entries, _, _, _, features = struct.unpack_from("<6I", p, 0)
        sq_off = struct.unpack_from("<7I", p, 40)    # head tail mask entries flags dropped array
        cq_off = struct.unpack_from("<6I", p, 80)    # head tail mask entries overflow cqes
        sq_size = sq_off[6] + sq_entries * 4
        cq_size = cq_off[5] + cq_entries * 16
        if features & FEAT_SINGLE_MMAP:
            sq_size = cq_size = max(sq_size, cq_size)
        self.sq = mmap.mmap(fd, sq_size, offset=OFF_SQ_RING)
        self.cq = self.sq if features & FEAT_SINGLE_MMAP else mmap.mmap(fd, cq_size, offset=OFF_CQ_RING)
        self.sqes = mmap.mmap(fd, sq_entries * 64, offset=OFF_SQES)
        self.sq_off, self.cq_off = sq_off, cq_off
        self.sq_mask = struct.unpack_from("<I", self.sq, sq_off[2])[0]
        self.cq_mask = struct.unpack_from("<I", self.cq, cq_off[2])[0]
        self.entries = sq_entries
        self.bufs: dict[int, ctypes.Array] = {}
        self.inflight = 0
        self.pending = 0

    def read(self, fd: int, size: int, offset: int, tag: int) -> None:
        """Queue one read (submitted by the next enter())."""
        buf = self.bufs.get(tag) or (ctypes.c_char * (size + 4096))()   # room to align
        self.bufs[tag] = buf
        tail = struct.unpack_from("<I", self.sq, self.sq_off[1])[0]
        idx = tail & self.sq_mask
        sqe = struct.pack("<BBHiQQIIQ", OP_READ, 0, 0, fd, offset, (ctypes.addressof(buf) + 4095) & ~4095, size, 0, tag)
        self.sqes[idx * 64: idx * 64 + 64] = sqe.ljust(64, b"\0")
        struct.pack_into("<I", self.sq, self.sq_off[6] + idx * 4, idx)
        struct.pack_into("<I", self.sq, self.sq_off[1], (tail + 1) & 0xFFFFFFFF)
        self.pending += 1

    def enter(self, wait: int = 0) -> list[tuple[int, int]]:
        """Submit what was queued, wait for ``wait`` completions, reap all: [(tag, res)]."""
        n = self.pending
        while True:
            r = _libc.syscall(SYS_ENTER, self.fd, n, wait, ENTER_GETEVENTS if wait else 0, None, 0)
            if r >= 0:
                break
            e = ctypes.get_errno()
            if e != 4:  # EINTR
                raise OSError(e, f"io_uring_enter: {os.strerror(e)}")
        self.pending = 0
        self.inflight += n
        out = []
        head = struct.unpack_from("<I", self.cq, self.cq_off[0])[0]
        tail = struct.unpack_from("<I", self.cq, self.cq_off[1])[0]
        while head != tail:
            off = self.cq_off[5] + (head & self.cq_mask) * 16
            tag, res, _ = struct.unpack_from("<QiI", self.cq, off)
            out.append((tag, res))
            head = (head + 1) & 0xFFFFFFFF
        struct.pack_into("<I", self.cq, self.cq_off[0], head)
        self.inflight -= len(out)
        return out

    def close(self) -> None:
        while self.inflight:
            self.enter(wait=1)
        for m in {id(self.sq): self.sq, id(self.cq): self.cq, id(self.sqes): self.sqes}.values():
            m.close()
        os.close(self.fd)


def watchdog(path: str, seconds: float, depth: int) -> dict:
    """stat, getxattr and pread on ``path`` in a loop while ``depth`` O_DIRECT reads of it
    stay in flight through io_uring; the slowest of each call."""
    import random
    import time
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    ring, rnd = Ring(64), random.Random(1)
    page = mmap.mmap(-1, 4096)      # aligned, as O_DIRECT wants
    worst = {"stat": 0.0, "getxattr": 0.0, "read": 0.0}
    loops = done = tag = eintr = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            while ring.inflight + ring.pending < depth:
                tag += 1
                ring.read(fd, 4096, rnd.randrange(size // 4096) * 4096, tag % 64)
            for _, res in ring.enter(0):
                if res < 0:
                    raise OSError(-res, f"io_uring read: {os.strerror(-res)}")
                done += 1
            for k in list(worst):
                t = time.monotonic()
                while True:     # (a spurious EINTR is counted: another test's business)
                    try:
                        if k == "stat":
                            os.stat(path)
                        elif k == "getxattr":
                            os.getxattr(path, "user.acache.state")
                        else:
                            os.preadv(fd, [page], rnd.randrange(size // 4096) * 4096)
                        break
                    except InterruptedError:
                        eintr += 1
                worst[k] = max(worst[k], time.monotonic() - t)
            loops += 1
        ring.close()
    finally:
        os.close(fd)
    return {"loops": loops, "uring_reads": done, "eintr": eintr, "worst": worst}


if __name__ == "__main__":
    import json
    import sys
    print(json.dumps(watchdog(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))), flush=True)
