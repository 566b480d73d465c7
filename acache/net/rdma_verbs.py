"""The pyverbs edge of the RDMA transport (acache.net.rdma has the design and the protocol).

The only module that imports pyverbs; acache.net.rdma imports it lazily, once a host is known
to have an RDMA device.  Everything pyverbs raises is translated here into VerbsError, whose
message is the short reason a connection's path shows ("IBV_WC_RETRY_EXC_ERR",
"ibv_post_send: ...").

    Device    an opened device port: RoCE v2 GIDs by IPv4 address, active MTU, limits
    Region    one mmap'ed buffer registered once as one MR (a pool of fixed-size slots)
    Endpoint  one RC queue pair with its CQ: RESET -> RTS, RDMA READ posts, CQ polls
    Reads     the reads in flight on one Endpoint: posts pieces (at most ``depth`` at once,
              from any threads), polls the CQ (whoever waits polls), matches completions

Lock order: Reads._poll_lock before Reads._lock.
"""
from __future__ import annotations

import ctypes
import ipaddress
import itertools
import mmap
import secrets
import threading
import time

import pyverbs.enums as e
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context, get_device_list
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, SendWR

MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}       # enum ibv_mtu
SERVE_ACCESS = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
LOCAL_ACCESS = e.IBV_ACCESS_LOCAL_WRITE


class VerbsError(Exception):
    """A verbs call or a completion failed; the message is the reason, short."""


def wc_name(status: int) -> str:
    try:
        return e.ibv_wc_status(status).name
    except ValueError:
        return f"completion status {status}"


def _verbs(what: str, ex: BaseException) -> VerbsError:
    return VerbsError(f"{what}: {ex}".splitlines()[0][:200])


def _ipv4(gid: str) -> str | None:
    try:
        v4 = ipaddress.IPv6Address(gid).ipv4_mapped
    except ValueError:
        return None
    return str(v4) if v4 is not None else None


class Device:
    """The first device port that is ACTIVE, on Ethernet (RoCE), with a RoCE v2 GID for an IPv4
    address (or the device ``want``).  InfiniBand link layers are not supported yet: they need
    LID addressing, which nothing here could test."""

    def __init__(self, want: str | None = None) -> None:
        try:
            devs = get_device_list()
        except PyverbsError:
            devs = []
        if not devs:
            raise VerbsError("no RDMA device on this host")
        reasons: list[str] = []
        for d in devs:
            name = d.name.decode()
            if want and name != want:
                continue
            try:
                ctx = Context(name=name)
                attr = ctx.query_device()
                for port in range(1, attr.phys_port_cnt + 1):
                    pa = ctx.query_port(port)
                    if pa.state != e.IBV_PORT_ACTIVE:
                        reasons.append(f"{name} port {port} is not active")
                        continue
                    if pa.link_layer != e.IBV_LINK_LAYER_ETHERNET:
                        reasons.append(f"{name} port {port}: InfiniBand link layer (RoCE only, for now)")
                        continue
                    gids = self._gids(ctx, port, pa.gid_tbl_len)
                    if not gids:
                        reasons.append(f"{name} port {port}: no RoCE v2 GID of an IPv4 address")
                        continue
                    self.ctx, self.name, self.port, self.gids = ctx, name, port, gids
                    self.mtu = int(pa.active_mtu)
                    self.max_rd_atom = int(attr.max_qp_rd_atom)
                    self.max_init_rd_atom = int(attr.max_qp_init_rd_atom)
                    self.max_msg = int(pa.max_msg_sz)
                    return
            except PyverbsError as ex:
                reasons.append(f"{name}: {ex}".splitlines()[0])
                continue
            ctx.close()
        raise VerbsError("; ".join(reasons) or f"no RDMA device named {want}")

    @staticmethod
    def _gids(ctx: Context, port: int, n: int) -> dict[str, tuple[int, str]]:
        """IPv4 address -> (GID index, GID) of the port's RoCE v2 entries."""
        out: dict[str, tuple[int, str]] = {}
        try:
            for g in ctx.query_gid_table(max(1, n)):
                if g.port_num == port and g.gid_type == e.IBV_GID_TYPE_ROCE_V2:
                    s = g.gid_str()
                    ip = _ipv4(s)
                    if ip is not None:
                        out.setdefault(ip, (g.gid_index, s))
            return out
        except (PyverbsError, AttributeError):
            pass                      # an older rdma-core: ask entry by entry
        for i in range(min(n, 32)):
            try:
                s = str(ctx.query_gid(port, i))
                if ctx.query_gid_type(port, i) != e.IBV_GID_TYPE_SYSFS_ROCE_V2:
                    continue
            except PyverbsError:
                continue
            ip = _ipv4(s)
            if ip is not None:
                out.setdefault(ip, (i, s))
        return out

    def info(self) -> dict:
        return {"dev": self.name, "port": self.port, "state": "ACTIVE", "mtu": MTU_BYTES.get(self.mtu, 0),
                "gids": sorted(self.gids)}

    def pd(self) -> PD:
        try:
            return PD(self.ctx)
        except PyverbsError as ex:
            raise _verbs("ibv_alloc_pd", ex)


class Region:
    """``size`` bytes of anonymous memory (page aligned, zeroed), registered once.  ``view`` is
    a memoryview of it: os.preadv and slice copies go straight in and out."""

    def __init__(self, pd: PD, size: int, access: int) -> None:
        self.size = size
        self.mem = mmap.mmap(-1, size)
        c = ctypes.c_char.from_buffer(self.mem)
        self.addr = ctypes.addressof(c)
        del c                          # no export left but ``view``
        self.view = memoryview(self.mem)
        try:
            self.mr = MR(pd, size, access, address=self.addr)
        except PyverbsError as ex:
            self.view.release()
            self.mem.close()
            raise _verbs(f"ibv_reg_mr of {size} bytes", ex)
        self.lkey, self.rkey = self.mr.lkey, self.mr.rkey

    def close(self) -> None:
        try:
            self.mr.close()            # deregistered first: no DMA into memory being freed
        except PyverbsError:
            pass
        try:
            self.view.release()
            self.mem.close()
        except BufferError:            # a slice of it is still alive somewhere: the GC frees it
            pass


class Endpoint:
    """One RC queue pair (created in RESET) with its own CQ."""

    def __init__(self, dev: Device, pd: PD, depth: int) -> None:
        self.dev = dev
        try:
            self.cq = CQ(dev.ctx, 2 * depth + 2)
            cap = QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            self.qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        except PyverbsError as ex:
            raise _verbs("ibv_create_qp", ex)
        self.qpn = self.qp.qp_num
        self.psn = secrets.randbits(24)

    def connect(self, local_ip: str, remote: dict, *, rd_atomic: int, timeout_exp: int = 14,
                retry: int = 7) -> None:
        """RESET -> INIT -> RTR -> RTS toward ``remote`` {qpn, psn, gid, mtu}: access flags,
        path MTU (the smaller active MTU), the RoCE v2 route from our GID of ``local_ip``.
        ``timeout_exp``: 4.096 us * 2^14 = 67 ms per try, ``retry`` tries: a peer that stops
        answering fails a READ with IBV_WC_RETRY_EXC_ERR after ~0.5 s."""
        idx, _ = self.dev.gids[local_ip]
        try:
            dgid = GID()
            dgid.gid = remote["gid"]
            gr = GlobalRoute(dgid=dgid, sgid_index=idx, hop_limit=64)
            attr = QPAttr(port_num=self.dev.port)
            attr.qp_access_flags = SERVE_ACCESS
            attr.path_mtu = min(self.dev.mtu, int(remote["mtu"]))
            attr.dest_qp_num = int(remote["qpn"])
            attr.rq_psn = int(remote["psn"])
            attr.sq_psn = self.psn
            attr.max_dest_rd_atomic = rd_atomic
            attr.max_rd_atomic = rd_atomic
            attr.min_rnr_timer = 12
            attr.timeout = timeout_exp
            attr.retry_cnt = retry
            attr.rnr_retry = 7
            attr.ah_attr = AHAttr(port_num=self.dev.port, is_global=1, gr=gr, dlid=0)
            self.qp.to_rts(attr)
        except (PyverbsError, ValueError, TypeError, KeyError) as ex:
            raise _verbs("queue pair to RTS", ex)

    def to_error(self) -> None:
        """Move the QP to the error state: posted work is flushed, nothing new runs."""
        try:
            attr = QPAttr()
            attr.qp_state = e.IBV_QPS_ERR
            self.qp.modify(attr, e.IBV_QP_STATE)
        except PyverbsError:
            pass

    def close(self) -> None:
        for x in (self.qp, self.cq):
            try:
                x.close()
            except PyverbsError:
                pass


class _Batch:
    __slots__ = ("left", "error", "event")

    def __init__(self, n: int) -> None:
        self.left = n
        self.error: str | None = None
        self.event = threading.Event()


class Reads:
    """RDMA READs on one Endpoint, from any threads.  Each ``run`` posts its pieces (the send
    queue holds ``depth``: the rest wait for completions) and waits for all of them; the thread
    that waits polls the CQ and hands other threads' completions to them."""

    def __init__(self, ep: Endpoint, depth: int) -> None:
        self.ep = ep
        self._sq = threading.Semaphore(depth)
        self._lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, _Batch] = {}
        self.users = 0
        # the first failure that put the QP in the error state (a deadline passed, or a
        # completion failed): the READs flushed by that state report it, not a bare FLUSH_ERR,
        # whichever thread gets to say it first
        self.cause: str | None = None

    def run(self, pieces: list[tuple[int, int, int, int]], rkey: int, deadline: float) -> None:
        """``pieces``: (local address, lkey, remote address, length).  VerbsError on the first
        failed completion (after the rest of the batch completed or was flushed) or when the
        deadline passes (the QP is then moved to the error state: a peer whose QP is in the error
        state never answers, and soft-RoCE does not always turn that into RETRY_EXC_ERR)."""
        t0 = time.monotonic()
        b = _Batch(len(pieces))
        with self._lock:
            self.users += 1
        try:
            i, spins = 0, 0
            while b.left:
                while i < len(pieces) and b.error is None and self._sq.acquire(blocking=False):
                    laddr, lkey, raddr, n = pieces[i]
                    wr_id = next(self._ids)
                    with self._lock:
                        self._waiting[wr_id] = b
                    try:
                        wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_READ, num_sge=1,
                                    sg=[SGE(laddr, n, lkey)], send_flags=e.IBV_SEND_SIGNALED)
                        wr.set_wr_rdma(rkey, raddr)
                        self.ep.qp.post_send(wr)
                    except PyverbsError as ex:
                        with self._lock:
                            self._waiting.pop(wr_id, None)
                        self._sq.release()
                        b.error = b.error or str(_verbs("ibv_post_send", ex))
                        break
                    i += 1
                if b.error is not None and i < len(pieces):
                    with self._lock:
                        b.left -= len(pieces) - i        # not posted after an error
                    i = len(pieces)
                if not b.left:
                    break
                if time.monotonic() > deadline:
                    why = b.error or f"no RDMA completion within {deadline - t0:.3g}s"
                    with self._lock:
                        self.cause = self.cause or why
                    self.ep.to_error()
                    raise VerbsError(self._rooted(why))
                if self._poll_lock.acquire(blocking=False):
                    try:
                        got = self._drain()
                    finally:
                        self._poll_lock.release()
                    if got:
                        spins = 0
                    else:
                        spins += 1
                        time.sleep(0 if spins < 200 else 0.0002 if spins < 2000 else 0.002)
                else:
                    b.event.wait(0.001)
                    b.event.clear()
            if b.error is not None:
                raise VerbsError(self._rooted(b.error))
        finally:
            with self._lock:
                self.users -= 1
                others = [w for w in self._waiting.values() if w is not b]
            if others:
                others[0].event.set()          # someone else polls now

    def _rooted(self, why: str) -> str:
        """A flushed READ's error named by what put the QP in the error state, when we know."""
        with self._lock:
            cause = self.cause
        if why == wc_name(e.IBV_WC_WR_FLUSH_ERR) and cause is not None:
            return cause
        return why

    def _drain(self) -> int:
        try:
            n, wcs = self.ep.cq.poll(num_entries=32)
        except PyverbsError as ex:
            err = str(_verbs("ibv_poll_cq", ex))
            with self._lock:
                stuck, self._waiting = set(self._waiting.values()), {}
                for w in stuck:
                    w.error, w.left = w.error or err, 0
                    w.event.set()
            raise VerbsError(err)
        for wc in wcs[:n]:
            with self._lock:
                b = self._waiting.pop(wc.wr_id, None)
                if b is not None:
                    if wc.status != e.IBV_WC_SUCCESS and b.error is None:
                        b.error = wc_name(wc.status)
                        if wc.status != e.IBV_WC_WR_FLUSH_ERR:
                            self.cause = self.cause or b.error
                    b.left -= 1
            self._sq.release()
            if b is not None and not b.left:
                b.event.set()
        return n
