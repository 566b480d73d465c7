"""A node as a member of a cluster (``meta = "etcd://h1:2379,.../NAME"``).

    member = Member(settings, cache, under, node_id)
    vfs = member.vfs                      # what the mount serves (acache.cluster.client)

It registers the node (a record + a leased alive key, acache.meta.cluster), serves its peer
ops on ``listen`` (the node's cache files: ``data.*``; the namespace while it is the head:
``ns.*``), and campaigns for the head role: the key ``head`` holds the id of the node that
runs the namespace, attached to that node's lease, so it disappears TTL seconds after the
head stops answering etcd, and another member takes over (opening the namespace KV fences
the old head's writes off).  A namespace call waits for a head -- the next one, during a
takeover -- for up to ``stall_timeout`` seconds, then fails with EIO and one log line.
"""
from __future__ import annotations

import errno
import logging
import math
import os
import queue
import signal
import threading
import time

from acache.cluster import schema
from acache.cluster.client import ClientVFS
from acache.cluster.head import CallEdge, HeadNamespace, attr_dict
from acache.data import barrier
from acache.errors import AcacheError, FsError, MetaError, UnderStoreError
from acache.fs.types import Ctx
from acache.net.transport import (Conn, FileRegion, PeerUnavailable, RemoteError, Reply,
                                  TransportError)

log = logging.getLogger("acache.cluster")
LEASE_TTL = 3.0
NOTE_THREADS = 4                 # the head's notes to holders in flight at once
ENOTHEAD = errno.ESTALE          # "ask the head, I am not it (any more)"


class Member:
    def __init__(self, settings, cache, under, node_id: str) -> None:
        from acache.meta.cluster import Cluster
        from acache.meta.etcd import EtcdClient
        from acache.net import transport_from_settings
        t0 = time.monotonic()
        self.settings, self.cache, self.under, self.node_id = settings, cache, under, node_id
        self.stall = settings.stall_timeout
        self.client = EtcdClient.from_url(settings.meta, stall_timeout=settings.stall_timeout)
        self.cluster = Cluster(self.client)
        self.head_key = self.client.prefix + b"head"
        self.transport = transport_from_settings(settings)
        self._conns: dict[str, Conn] = {}
        self._rid = 0
        # this process (a restart gets another): request ids, and the identity a node
        # starting under the same node_id asks for (_register)
        self._boot = f"{time.time_ns():x}-{os.urandom(4).hex()}"
        self._addr: dict[str, str] = {}
        self._lock = threading.Lock()
        # one campaign at a time: the campaign thread and every namespace call waiting for a
        # head campaign; two that both saw no head would each build a _Head (two namespace
        # writers, the second fencing the first's KV off, two persisters)
        self._campaign_lock = threading.Lock()
        self.head: _Head | None = None    # while this node is the head
        self._head_id: str | None = None
        self._stop = threading.Event()
        self._check_secret()
        # the head's notes to holders (best effort, off the caller's thread): a few daemon
        # threads on one queue, not a thread per note, whose start the caller (the persister,
        # under the head's lock) would wait for
        self._notes: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(NOTE_THREADS):
            threading.Thread(target=self._note_loop, name=f"acache-notify-{i}", daemon=True).start()
        # Began notices to a head elsewhere (announce), sent by one thread, queued ones together
        self._began_n = 0
        self._began_q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._began_loop, name="acache-began", daemon=True).start()
        cache.on_stall = self.hurry      # writers wait for room: the head persists now
        # a node without a cache (placement = "hash") writes into workers' caches
        # (acache.cluster.cacheless), takes no placed files and never runs the head (its
        # persister would need a cache); a worker serves their write sessions
        self.worker = settings.placement != "hash"
        self.vfs: ClientVFS
        if self.worker:
            self.vfs = ClientVFS(node_id, cache, under, self.ns, self.conn,
                                 chunk_size=settings.chunk_size, incarnation=self.incarnation,
                                 announce=self.announce)
        else:
            from acache.cluster.cacheless import CachelessVFS
            self.vfs = CachelessVFS(node_id, cache, under, self.ns, self.conn,
                                    chunk_size=settings.chunk_size)
        self.listener = self.transport.listen(settings.listen)
        self.address = settings.advertise or self.listener.address
        for op in ("read", "drop", "clean", "stage_part", "stage_file"):
            self.listener.register(f"data.{op}", getattr(self, f"_data_{op}"))
        self.sessions = None
        if self.worker:
            from acache.cluster.worker import WriteSessions
            self.sessions = WriteSessions(self.vfs, cache)
            self.sessions.register(self.listener)
        self.listener.register("ns", self._serve_ns)
        # close-began notices: numbered on the connection's reader thread as they arrive, before
        # any request behind them is handed to a worker (a close sent after its notice on the
        # same stream is numbered after it); no worker, no request log
        self.listener.register("ns.began", self._serve_began, inline=True)
        self.listener.advertise("ns_ops", schema.served())
        self.listener.advertise("node", {"id": node_id, "boot": self._boot})
        self.listener.start()
        caps: tuple[str, ...] = ("rdma",) if self.transport.name == "rdma" and getattr(self.transport, "dev", None) else ()
        if self.worker:
            from acache.cluster.placement import WORKER
            caps += (WORKER,)
        try:
            self.registration = self._register(caps)
        except AcacheError:
            self._close_unjoined()
            raise
        self.vfs.recover()
        self._campaign_once()
        self._rejoin()
        self._thread = threading.Thread(target=self._campaign, name="acache-head-campaign", daemon=True)
        self._thread.start()
        log.info("joined cluster %s as %s at %s in %.1f s (transport %s; head: %s)",
                 settings.meta, node_id, self.address, time.monotonic() - t0, self.transport.name,
                 self._head_id or "none yet")

    def _check_secret(self) -> None:
        """Refuse to join with a secret other than the cluster's, before registering or
        campaigning: such a node cannot talk to any peer, and as the head it would cut every
        other node off.  etcd keeps an HMAC of the cluster's name under the first member's
        secret (it reveals nothing of the secret); a node whose secret gives another refuses."""
        import hashlib
        import hmac
        from acache.errors import ConfigError
        from acache.meta.etcd import Compare, Put
        from acache.net import auth
        secret = auth.load_secret(self.settings.secret_file) if self.settings.secret_file else None
        if not secret:
            return                          # loopback without a secret: nothing to compare
        key = self.client.prefix + b"secret_check"
        tag = hmac.new(secret, b"acache-cluster-secret\0" + self.client.prefix,
                       hashlib.sha256).hexdigest().encode()
        self.client.txn([Compare.absent(key)], [Put(key, tag)])
        cur = self.client.get(key)
        if cur is not None and not hmac.compare_digest(cur.value, tag):
            log.error("secret_file %s is not the secret of cluster %s: not joining",
                      self.settings.secret_file, self.settings.meta)
            raise ConfigError(f"secret_file {self.settings.secret_file} is not the secret the "
                              f"cluster's other nodes use ({self.settings.meta}); not joining. "
                              f"(If the cluster's secret was changed on purpose, delete the etcd "
                              f"key {key.decode(errors='replace')} once every node has the new one.)")

    def _register(self, caps: tuple[str, ...]):
        """Register this node unless its node_id is another live process's: one process per
        id.  A live registration of the id may be this node's own from before a kill -9 (its
        lease not expired yet) or another process (a cloned VM, two pods with one host name):
        the registered address is asked who it is (the handshake's ``node``).  The same id
        under another boot token: refused, before anything is written (no registration, no
        campaign: the running node notices nothing).  No answer, another id, or this very
        process (same address, after a restart): stale, replaced as before.  Two starting at
        once: the register is guarded (acache.meta.cluster), the loser refuses the same way."""
        from acache.meta.cluster import IdInUse
        held = self.cluster.holder(self.node_id)
        expect = 0
        if held is not None:
            addr = held.record.address if held.record else None
            who = self._who_is(addr) if addr else None
            if addr and who is not None and who.get("id") == self.node_id and who.get("boot") != self._boot:
                raise self._in_use(addr)
            log.info("node_id %s has a live registration at %s (%s): taken as this node's own "
                     "from before a restart", self.node_id, addr,
                     "it does not answer" if who is None else "another node answers there"
                     if who.get("id") != self.node_id else "this process answers there")
            expect = held.revision
        try:
            return self.cluster.register(self.node_id, self.address, caps, ttl=LEASE_TTL,
                                         expect=expect)
        except IdInUse as e:
            raise self._in_use(e.holder.record.address if e.holder and e.holder.record
                               else "an unknown address") from None

    def _who_is(self, address: str) -> dict | None:
        """What the node at ``address`` says it is (its handshake's ``node``: id, boot);
        None if nothing answers there (or a node of an acache that does not say)."""
        try:
            c = self.transport.connect(address)
        except (TransportError, OSError) as e:
            log.debug("asking %s who it is: %s", address, e)
            return None
        try:
            who = c.peer_capabilities.get("node")
        finally:
            c.close()
        return who if isinstance(who, dict) else None

    def _in_use(self, address: str):
        from acache.errors import ConfigError
        msg = (f"node_id {self.node_id!r} is in use: a live node of cluster {self.settings.meta} "
               f"at {address} is registered under it; not joining (give this node another "
               f"node_id, in its config or ACACHE_NODE_ID)")
        log.error("%s", msg)
        return ConfigError(msg)

    def _close_unjoined(self) -> None:
        """Undo the start before registering: nothing of it is in etcd."""
        for _ in range(NOTE_THREADS):
            self._notes.put(None)
        self._began_q.put(None)
        self.listener.close()
        if not self.worker:
            from acache.cluster.cacheless import CachelessVFS
            if isinstance(self.vfs, CachelessVFS):     # it is (no cache here): its sender pools
                self.vfs.close()
        self.client.close()

    # -- peers ---------------------------------------------------------------------------
    def address_of(self, node_id: str) -> str:
        addr = self._addr.get(node_id)
        if addr is None:
            rec = self.client.get(self.cluster.node_key(node_id))
            if rec is None:
                raise PeerUnavailable(f"node {node_id} is not registered")
            from acache.meta.cluster import NodeRecord
            addr = self._addr[node_id] = NodeRecord.unpack(rec.value).address
        return addr

    def incarnation(self, node_id: str) -> bytes | None:
        """What changes when ``node_id`` registers again (a restart: its alive key, the id
        of its lease); None while it is down."""
        kv = self.client.get(self.cluster.alive_key(node_id))
        return None if kv is None else kv.value

    def conn(self, node_id: str) -> Conn:
        with self._lock:
            c = self._conns.get(node_id)
        if c is None:
            c = self.transport.connect(self.address_of(node_id))
            with self._lock:
                if node_id in self._conns:
                    c.close()
                    c = self._conns[node_id]
                else:
                    self._conns[node_id] = c
        return c

    def _drop_conn(self, node_id: str) -> None:
        with self._lock:
            c = self._conns.pop(node_id, None)
            self._addr.pop(node_id, None)
        if c is not None:
            c.close()

    def peers(self) -> list[dict]:
        out = []
        for m in self.cluster.members():
            c = self._conns.get(m.record.id)
            out.append({"id": m.record.id, "address": m.record.address, "alive": m.alive,
                        "worker": "worker" in m.record.capabilities,
                        "head": m.record.id == self._head_id,
                        "transport": "self" if m.record.id == self.node_id else
                        (c.path if c is not None else "not connected")})
        return out

    # -- the cache files of this node, for peers ------------------------------------------
    def _data_read(self, meta: dict, payload) -> Reply:
        got = _naturals(meta, "ino", "gen", "offset", "length")
        if got is None:
            raise OSError(errno.EINVAL, "bad read request")
        ino, gen, off, n = got
        try:
            fd = self.cache.acquire(ino, gen)
        except FileNotFoundError:
            raise OSError(errno.ENOENT, f"inode {ino} generation {gen} is not cached here") from None
        import os
        size = os.fstat(fd).st_size
        return Reply({}, FileRegion(fd, off, max(0, min(n, size - off)),
                                    release=lambda: self.cache.release(ino, gen)))

    def _data_stage_part(self, meta: dict, payload) -> dict:
        """The head stages a file this node holds (S3 multipart): upload one part of it
        from this node's cache file, answer its ETag (acache.data.under.s3 stage_parts)."""
        got = _naturals(meta, "ino", "gen", "number", "offset", "length")
        path, upload_id = meta.get("path"), meta.get("upload_id")
        if got is None or not (isinstance(path, str) and isinstance(upload_id, str)):
            raise OSError(errno.EINVAL, "bad part request")
        ino, gen, number, off, n = got
        send = getattr(self.under, "upload_part_from", None)
        if send is None:
            raise OSError(errno.EOPNOTSUPP, "this node's under-storage takes no parts")
        return self._from_cache_file(
            ino, gen, lambda fd: {"etag": send(path, upload_id, fd, number, off, n)})

    def _data_stage_file(self, meta: dict, payload) -> dict:
        """The head stages a file this node holds (a POSIX under-storage the nodes share):
        write the stage's temp file from this node's cache file; the head commits it."""
        got = _naturals(meta, "ino", "gen", "size")
        path, token, attrs = meta.get("path"), meta.get("token"), meta.get("attrs") or []
        if got is None or not (isinstance(path, str) and isinstance(token, str)
                               and isinstance(attrs, list)):
            raise OSError(errno.EINVAL, "bad stage request")
        ino, gen, size = got
        if not hasattr(self.under, "staged_from"):
            raise OSError(errno.EOPNOTSUPP, "this node's under-storage is not a shared directory")
        from acache.data.under.base import Attrs
        return self._from_cache_file(ino, gen, lambda fd: self.under.stage(
            path, token, f"/proc/self/fd/{fd}", size, attrs=Attrs.unpack(attrs)).made())

    def _from_cache_file(self, ino: int, gen: int, fn) -> dict:
        """fn(fd) on this node's cache file of (ino, gen), held meanwhile (never removed
        under it), for a stage request of the head; its under-storage errors are EIO."""
        try:
            fd = self.cache.acquire(ino, gen)
        except FileNotFoundError:
            raise OSError(errno.ENOENT, f"inode {ino} generation {gen} is not cached here") from None
        try:
            return fn(fd)
        except UnderStoreError as e:
            raise OSError(errno.EIO, str(e)) from None
        finally:
            self.cache.release(ino, gen)

    def _data_drop(self, meta: dict, payload) -> dict:
        self.vfs.drop(int(meta["ino"]), int(meta["gen"]))
        return {}

    def _data_clean(self, meta: dict, payload) -> dict:
        self.vfs.clean(int(meta["ino"]), int(meta["gen"]))
        return {}

    def notify(self, holder: str, what: str, ino: int, gen: int) -> None:
        """The head tells a holder what became of its cache file (best effort, async)."""
        if holder == self.node_id:
            (self.vfs.drop if what == "drop" else self.vfs.clean)(ino, gen)
            return

        def send() -> None:
            try:
                self.conn(holder).request(f"data.{what}", {"ino": ino, "gen": gen}, timeout=10)
            except (TransportError, OSError) as e:
                log.debug("telling %s to %s inode %d: %s", holder, what, ino, e)
        self._notes.put(send)

    def announce(self) -> str:
        """A close began here (the engine read its FLUSH): tell the head now, ahead of the
        close (acache.cluster.head.CallEdge.began); the token the close is to carry.  Best
        effort: a notice that is late or lost leaves the close ordered by its own arrival."""
        with self._lock:
            self._began_n += 1
            token = f"{self._boot}:{self._began_n}"
        head = self.head
        if head is not None:
            head.edge.began(self.node_id, [token])
        else:
            self._began_q.put(token)
        return token

    def _serve_began(self, meta: dict, payload) -> dict:
        head = self.head
        if head is None:
            raise OSError(ENOTHEAD, "not the head")
        tokens = meta.get("tokens")
        if not isinstance(tokens, list) or len(tokens) > 1024 or \
                not all(isinstance(t, str) and len(t) <= 256 for t in tokens):
            raise OSError(errno.EINVAL, "ns.began: tokens must be a list of short strings")
        head.edge.began(str(meta.get("from", "")), tokens)
        head.calls["began"] = head.calls.get("began", 0) + 1
        return {}

    def hurry(self) -> None:
        """This node's cache is full of dirty data and its writers wait for room
        (CacheDir.on_stall): the files are persisted by the head's persister, which is asked
        to start now rather than after the flush delay.  Best effort and off the writer's
        thread: a lost request leaves the flush delay, then the writer's stall_timeout."""
        head = self.head
        if head is not None:
            head.persister.hurry(head.meta.last_seq())
            return

        def send() -> None:
            hid = self._head_id
            if hid is None or hid == self.node_id or self._stop.is_set():
                return
            try:
                self.conn(hid).request("ns", {"from": self.node_id, "op": "hurry", "args": {},
                                              "rid": ""}, timeout=5.0)
            except (TransportError, OSError, AcacheError) as e:   # ENOSYS: an older head
                log.debug("asking %s to persist now: %s", hid, e)
        self._notes.put(send)

    def _began_loop(self) -> None:
        inline = True                    # "ns.began" at the head; an older head: "ns" began
        while (token := self._began_q.get()) is not None:
            tokens = [token]
            while len(tokens) < 64:
                try:
                    tokens.append(self._began_q.get_nowait())
                except queue.Empty:
                    break
            hid = self._head_id
            if hid is None or hid == self.node_id or self._stop.is_set():
                continue
            try:
                if inline:
                    try:
                        self.conn(hid).request("ns.began", {"from": self.node_id, "tokens": tokens},
                                               timeout=2.0)
                        continue
                    except RemoteError as e:
                        if e.errno != errno.ENOSYS:
                            raise
                        inline = False
                self.conn(hid).request("ns", {"from": self.node_id, "op": "began",
                                              "args": {"tokens": tokens}, "rid": ""}, timeout=2.0)
            except (TransportError, OSError, AcacheError) as e:
                log.debug("a close-began notice to %s: %s", hid, e)

    def _note_loop(self) -> None:
        while (send := self._notes.get()) is not None:
            try:
                send()
            except Exception:                   # a note is best effort; the thread stays
                log.exception("a note to a holder failed")

    # -- the namespace ------------------------------------------------------------------------
    def _serve_ns(self, meta: dict, payload) -> dict:
        head = self.head
        if head is None:
            raise OSError(ENOTHEAD, "not the head")
        try:
            req = schema.decode(meta.get("op"), meta.get("args"))
            out = head.call(str(meta["from"]), req, str(meta.get("rid") or ""))
            _test_kill_before_reply(req.op, meta.get("args") or {})
            return out
        except FsError as e:
            raise OSError(e.errno, str(e)) from None
        except MetaError as e:
            raise OSError(errno.EIO, str(e)) from None

    def ns(self, op: str, **args) -> dict:
        """``call(schema.request(op, **args))``: the VFS's short form."""
        return self.call(schema.request(op, **args))

    def call(self, req: schema.Request) -> dict:
        """One namespace operation at the head, wherever it is (see the module docstring)."""
        op, wire_args = schema.encode(req)
        deadline = time.monotonic() + self.stall
        if isinstance(req, schema.Flush):   # the barrier waits as long as it was asked to, not
            wait = req.timeout              # stall_timeout: each try below still gives up on a
            deadline = math.inf if wait is None else deadline + wait    # silent head
        logged = False
        with self._lock:
            self._rid += 1
            rid = f"{self.node_id}:{self._boot}:{self._rid}"
        while True:
            head = self.head
            if head is not None:
                try:
                    return head.call(self.node_id, req, rid)
                except MetaError as e:
                    if self.head is head:
                        log.error("metadata operation %s failed: %s", op, e)
                        raise FsError(errno.EIO) from None
                    # lost the head role meanwhile: ask the new one
            else:
                hid = self._head_id or self._read_head()
                if hid is not None and hid != self.node_id:
                    try:
                        reply, _ = self.conn(hid).request(
                            "ns", {"from": self.node_id, "op": op, "args": wire_args, "rid": rid},
                            timeout=max(1.0, min(deadline - time.monotonic(), self.stall)))
                        return reply
                    except RemoteError as e:
                        if e.errno != ENOTHEAD:
                            raise FsError(e.errno) from None
                        self._head_id = None
                    except TransportError as e:
                        if not logged:
                            log.warning("the head %s does not answer (%s); waiting up to %.0f s",
                                        hid, e, max(0, deadline - time.monotonic()))
                            logged = True
                        self._drop_conn(hid)
                        self._head_id = None
            if time.monotonic() > deadline:
                log.error("no cluster head answered %s within %.0f s (stall_timeout): EIO", op,
                          self.stall)
                raise FsError(errno.EIO)
            self._stop.wait(0.05)
            self._campaign_once()

    def _read_head(self) -> str | None:
        try:
            kv = self.client.get(self.head_key)
        except MetaError:
            return None
        self._head_id = kv.value.decode() if kv is not None else None
        return self._head_id

    # -- the head role -------------------------------------------------------------------------
    def _campaign_once(self) -> None:
        with self._campaign_lock:
            self._campaign_locked()

    def _campaign_locked(self) -> None:
        from acache.meta.etcd import Compare, Put
        if self.head is not None or self._stop.is_set():
            return
        if not self.worker:              # no cache for the head's persister: only learn who it is
            self._read_head()
            return
        try:
            lease = self.registration.lease_id
            res = self.client.txn([Compare.absent(self.head_key)],
                                  [Put(self.head_key, self.node_id.encode(), lease)])
            cur = self.client.get(self.head_key)
        except MetaError as e:
            log.debug("campaign: %s", e)
            return
        mine = cur is not None and cur.value == self.node_id.encode()
        if cur is not None and cur.lease != lease and mine:
            # ours from before a restart, on an old lease: take it over on the new one
            self.client.txn([Compare.mod_revision(self.head_key, cur.mod_revision)],
                            [Put(self.head_key, self.node_id.encode(), lease)])
        if mine or res.succeeded:
            try:
                head = _Head(self)
            except Exception as e:
                log.error("taking the head role failed: %s", e)
                self.client.txn([Compare.value(self.head_key, self.node_id.encode())],
                                [_delete(self.head_key)])
                return
            if self._stop.is_set():      # close() gave up waiting for this campaign
                head.close()
                return
            self.head = head
            self._head_id = self.node_id
            log.info("this node (%s) is the cluster's head now", self.node_id)
        else:
            self._head_id = cur.value.decode() if cur is not None else None

    def _campaign(self) -> None:
        while not self._stop.wait(0.5):
            if self.head is not None:
                try:
                    cur = self.client.get(self.head_key)
                except MetaError:
                    continue
                if cur is None or cur.value != self.node_id.encode():
                    with self._campaign_lock:
                        head, self.head = self.head, None
                    if head is not None:
                        log.error("this node lost the head role (its lease expired): stepping down")
                        head.close()
            else:
                self._campaign_once()

    def _rejoin(self) -> None:
        files = [[ino, gen, size] for ino, (gen, size) in self.vfs.local_files().items()]
        try:
            out = self.call(schema.Rejoin(files=files))
        except FsError as e:
            log.error("rejoining the cluster's head failed (%s); cache files stay dirty", e)
            return
        for ino, gen in out.get("clean", []):
            self.vfs.clean(ino, gen)
        for ino, gen in out.get("drop", []):
            self.vfs.drop(ino, gen)
        log.info("rejoined the cluster: %s", {k: v for k, v in out.items() if k not in ("clean", "drop")})

    def close(self) -> None:
        self._stop.set()
        # a campaign under way finishes first (its head closes here), unless it hangs on an
        # unreachable etcd: then it sees _stop and closes the head it built itself
        got = self._campaign_lock.acquire(timeout=5)
        try:
            head, self.head = self.head, None
        finally:
            if got:
                self._campaign_lock.release()
        if head is not None:
            head.close()
            try:
                from acache.meta.etcd import Compare
                self.client.txn([Compare.value(self.head_key, self.node_id.encode())],
                                [_delete(self.head_key)])
            except MetaError:
                pass
        try:
            self.registration.stop()
        except Exception:
            pass
        for _ in range(NOTE_THREADS):
            self._notes.put(None)
        self.listener.close()
        if not self.worker:
            from acache.cluster.cacheless import CachelessVFS
            if isinstance(self.vfs, CachelessVFS):     # it is (no cache here): its sender pools
                self.vfs.close()
        for c in list(self._conns.values()):
            c.close()
        self.client.close()


def _naturals(meta: dict, *keys: str) -> list[int] | None:
    """The values of ``keys`` in a peer's request, each an int >= 0; None if one is not."""
    out = []
    for k in keys:
        v = meta.get(k)
        if not isinstance(v, int) or v < 0:
            return None
        out.append(v)
    return out


KILL_BEFORE_REPLY = "ACACHE_TEST_KILL_BEFORE_REPLY"


def _test_kill_before_reply(op: str, args: dict) -> None:
    """Tests only: ``ACACHE_TEST_KILL_BEFORE_REPLY=<marker file>:<op>:<name>`` -- the head
    kills itself (SIGKILL) after a remote request ``op`` on ``name`` ran and landed in etcd,
    before its reply is sent: a request whose reply is lost with the head.  Once across all
    processes (the marker file is created first); the head that answers the copy sent again
    does not fire it."""
    spec = os.environ.get(KILL_BEFORE_REPLY)
    if not spec:
        return
    marker, want_op, name = spec.rsplit(":", 2)
    got = args.get("name")
    got = got.decode(errors="surrogateescape") if isinstance(got, bytes) else got
    if op != want_op or got != name:
        return
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    log.warning("test hook %s: killing this head before the reply to %s %s", KILL_BEFORE_REPLY,
                op, name)
    os.kill(os.getpid(), signal.SIGKILL)


def _delete(key: bytes):
    from acache.meta.etcd import Delete
    return Delete(key)


class _Head:
    """The namespace, while this node is the head."""

    def __init__(self, member: Member) -> None:
        from acache.data.persister import Persister
        from acache.meta.kv_etcd import EtcdKV
        from acache.meta.store import MetaStore
        s = member.settings
        self.member = member
        self.kv = EtcdKV(member.client, member.client.prefix + b"ns/")
        self.meta = MetaStore(self.kv)
        # the bytes of a PUT are on its holder: pulled or staged from there (Holders)
        self.persister = Persister(self.meta, member.cache, member.under,
                                   flush_delay=s.flush_delay, concurrency=s.upload_concurrency,
                                   holders=self)
        self.vfs = HeadNamespace(self.meta, member.cache, member.under, self.persister,
                                 node_id=member.node_id, notify=member.notify,
                                 chunk_size=s.chunk_size)
        self._no_parts: set[str] = set()    # holders that said they take no parts: pulled
        self.cache = member.cache
        from acache.cluster.placement import Placement
        self.placement = Placement(member.cluster)
        self._blocked: tuple[str, float] = ("", 0.0)     # (node, since) for status
        self.edge = CallEdge(self.meta)
        from acache.cluster.requests import RequestLog
        self.requests = RequestLog(self.meta, edge=self.edge.run)
        self.calls: dict[str, int] = {}      # namespace requests served, by op (status)
        rec = self.vfs.recover()
        if any(rec.values()):
            log.info("head: recovered %s", rec)
        self.persister.start()
        from acache.cluster.sessions import Reaper
        self.reaper = Reaper(self.vfs.session_nodes, self._alive, self.vfs.release_node)

    def _alive(self) -> set[str] | None:
        """The nodes whose registration is alive (None: etcd does not answer now)."""
        try:
            return {m.record.id for m in self.member.cluster.members() if m.alive}
        except MetaError:
            return None

    def close(self) -> None:
        self.reaper.close()
        self.placement.close()
        try:
            self.persister.stop()
        finally:
            self.meta.close()            # what is queued is written, then the KV closed

    def stage_elsewhere(self, e, progress, on_token):
        """Stage PUT ``e`` with no copy of its bytes here: its holder uploads each part
        from its own cache file, this node (the head) creates, records and later completes
        the upload in order.  None where that cannot be (the holder is this node, a small
        file sent whole, an under-storage without parts): ``pull`` copies it here first."""
        holder, under = e.node, self.member.under
        if not holder or holder == self.member.node_id or e.size == 0 or holder in self._no_parts:
            return None
        from acache.data.under.base import Attrs
        grace = getattr(under, "read_timeout", 60.0) + 30.0
        if hasattr(under, "staged_from"):
            if not self._holder_serves(holder, "data.stage_file"):
                return None
            return self._stage_file_elsewhere(e, holder, progress, grace)
        if not hasattr(under, "stage_parts") or not under.parts_elsewhere(e.size):
            return None
        if not self._holder_serves(holder, "data.stage_part"):
            return None

        def send_part(upload_id: str, number: int, offset: int, length: int) -> str:
            args = {"ino": e.ino, "gen": e.gen, "path": e.path, "upload_id": upload_id,
                    "number": number, "offset": offset, "length": length}
            reply = self._ask_holder(holder, "data.stage_part", args, grace + length / (1 << 20),
                                     f"part {number} of {e.path} from {holder}")
            etag = reply.get("etag")
            if not isinstance(etag, str) or not etag:
                raise UnderStoreError(f"part {number} of {e.path} from {holder}: no ETag",
                                      retryable=True)
            return etag
        return under.stage_parts(e.path, e.token, e.size, send_part, progress,
                                 attrs=Attrs.unpack(e.attrs), on_token=on_token)

    def _stage_file_elsewhere(self, e, holder: str, progress, grace: float):
        """A POSIX under-storage every node mounts: the holder writes the stage's temp
        file (``e.token``, recorded before this) from its cache; committed here."""
        args = {"ino": e.ino, "gen": e.gen, "path": e.path, "token": e.token, "size": e.size,
                "attrs": list(e.attrs or [])}
        made = self._ask_holder(holder, "data.stage_file", args, grace + e.size / (1 << 20),
                                f"staging {e.path} on {holder}")
        staged = self.member.under.staged_from(e.token, e.path, made)
        progress(e.size)
        return staged

    def _holder_serves(self, holder: str, op: str) -> bool:
        """Does ``holder`` serve ``op``?  Its handshake lists the ops it serves; a node of an
        older acache (a rolling upgrade) that cannot stage is remembered, and its files are
        copied here instead.  Unknown (the holder does not answer now): True, and the request
        itself fails and is retried as usual."""
        try:
            ops = self.member.conn(holder).peer_capabilities.get("ops")
        except (TransportError, OSError):
            return True
        if isinstance(ops, list) and op not in ops:
            log.info("node %s does not serve %s (an older acache?): its files are copied to "
                     "the head before they are staged", holder, op)
            self._no_parts.add(holder)
            return False
        return True

    def _ask_holder(self, holder: str, op: str, args: dict, timeout: float, what: str) -> dict:
        """One stage request to a holder; any failure is a retryable UnderStoreError (a
        holder that cannot stage is remembered: the next attempt copies the file here)."""
        try:
            reply, _ = self.member.conn(holder).request(op, args, timeout=timeout)
            return reply
        except RemoteError as err:
            if err.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                self._no_parts.add(holder)
            raise UnderStoreError(f"{what}: {err}", retryable=True) from None
        except (TransportError, OSError) as err:
            self.member._drop_conn(holder)
            raise UnderStoreError(f"{what}: {err}", retryable=True) from None

    def pull(self, e) -> None:
        """Copy the bytes of PUT ``e`` from its holder into this cache (before staging)."""
        import os
        from acache.errors import UnderStoreError
        holder = e.node
        with self.vfs.lock:      # a copy here: that generation is not written in place again
            self.vfs._unread.pop((e.ino, e.gen), None)
        if not holder or holder == self.member.node_id or e.size == 0:
            if not self.cache.exists(e.ino, e.gen):
                self.cache.create_empty(e.ino, e.gen)
            return
        path = self.cache.path(e.ino, e.gen)
        if self.cache.exists(e.ino, e.gen) and os.stat(path).st_size >= e.size:
            return
        fd = self.cache.acquire(e.ino, e.gen, create=True, write=True)
        try:
            self.vfs.fetch.forget(e.ino, e.gen)
            reader = self.member.vfs._reader({"gen": e.gen, "holder": holder, "cached": True}, e.ino)
            try:
                self.vfs.fetch.fetch_all(e.ino, e.gen, fd, lambda: e.path, e.size, reader=reader)
            except FsError as err:
                raise UnderStoreError(f"copying {e.path} from {holder}: {err}", retryable=True) from None
            self.vfs.fetch.forget(e.ino, e.gen)
        finally:
            self.cache.release(e.ino, e.gen, write=True)
        self.cache.note(e.ino, e.gen, dirty=True)

    # -- the ops -------------------------------------------------------------------------------
    # requests that change nothing (or, rejoin, that are idempotent with a large reply):
    # their replies are not stored (acache.cluster.requests)
    NOT_LOGGED = frozenset({"lookup", "getattr", "readlink", "readdir", "sync", "getxattr",
                            "source", "journal", "status", "flush", "rejoin", "began",
                            "hurry"})

    def call(self, frm: str, req: schema.Request, rid: str = "") -> dict:
        """One namespace operation (``req``, checked: acache.cluster.schema) asked by node
        ``frm``.  ``rid``: the caller's id of this request; one sent again (its reply was lost
        with a connection, or with the head that ran it) is answered as its first run was
        (acache.cluster.requests)."""
        op_fn = getattr(self, "op_" + req.op, None)
        if op_fn is None:                # in the table, not handled here: a bug (test_ns_schema)
            raise FsError(errno.ENOSYS)
        self.calls[req.op] = self.calls.get(req.op, 0) + 1
        if isinstance(req, schema.Began):     # a number, no more: outside the edge
            return op_fn(frm, req)
        began = (frm, req.began) if isinstance(req, schema.Close) and req.began else None
        return self.requests.run(frm, rid, lambda: op_fn(frm, req),
                                 durable=req.op not in self.NOT_LOGGED, began=began)

    @staticmethod
    def _ctx(r) -> Ctx:
        return Ctx(**(r.ctx or {}))

    def op_began(self, frm, r):
        """Closes began on ``frm`` (acache.cluster.head.CallEdge.began); run outside the edge."""
        self.edge.began(frm, r.tokens)
        return {}

    def op_lookup(self, frm, r):
        return attr_dict(self.vfs.lookup(r.parent, r.name))

    def op_getattr(self, frm, r):
        return attr_dict(self.vfs.getattr(r.ino))

    def op_setattr(self, frm, r):
        return attr_dict(self.vfs.setattr(r.ino, self._ctx(r), None, mode=r.mode,
                                          uid=r.uid, gid=r.gid,
                                          atime_ns=r.atime_ns, mtime_ns=r.mtime_ns))

    def op_mkdir(self, frm, r):
        return attr_dict(self.vfs.mkdir(r.parent, r.name, r.mode, self._ctx(r)))

    def op_symlink(self, frm, r):
        return attr_dict(self.vfs.symlink(r.parent, r.name, r.target, self._ctx(r)))

    def op_mknod(self, frm, r):
        return attr_dict(self.vfs.mknod(r.parent, r.name, r.mode, r.rdev, self._ctx(r), frm))

    def op_readlink(self, frm, r):
        return {"target": self.vfs.readlink(r.ino)}

    def op_unlink(self, frm, r):
        self.vfs.unlink(r.parent, r.name)
        return {}

    def op_rmdir(self, frm, r):
        self.vfs.rmdir(r.parent, r.name)
        return {}

    def op_rename(self, frm, r):
        self.vfs.rename(r.parent_old, r.name_old, r.parent_new, r.name_new, r.flags)
        return {}

    READDIR_PAGE = 2000          # entries per reply: far below the transport's 1 MiB of meta

    def op_readdir(self, frm, r):
        """One page of a directory's entries from ``offset`` (``more``: ask again from ``next``)."""
        page, more = self.vfs.list_page(r.ino, int(r.offset), self.READDIR_PAGE)
        return {"entries": [[n, attr_dict(at)] for n, at, _ in page],
                "next": page[-1][2] if page else 0, "more": more}

    def op_sync(self, frm, r):
        self.meta.sync()
        return {}

    def op_getxattr(self, frm, r):
        return {"value": self.vfs.getxattr(r.ino, r.name)}

    def op_setxattr(self, frm, r):
        self.vfs.setxattr(r.ino, r.name, b"")
        return {}

    def op_removexattr(self, frm, r):
        self.vfs.removexattr(r.ino, r.name)
        return {}

    def _place(self, r):
        """A cacheless writer's files go to a worker (acache.cluster.placement)."""
        if not r.place:
            return None
        if not self.placement.workers():
            log.error("no live cache worker for a new file of a cacheless client: EIO")
            raise FsError(errno.EIO)
        return self.placement.choose

    def op_create(self, frm, r):
        return self.vfs.create_file(r.parent, r.name, r.mode, r.flags, self._ctx(r), frm,
                                    self._place(r), r.copy_max)

    def op_open_write(self, frm, r):
        return self.vfs.open_write(r.ino, bool(r.trunc), frm, self._place(r), r.copy_max)

    def op_source(self, frm, r):
        return self.vfs.source(r.ino)

    def op_open_read(self, frm, r):
        return self.vfs.open_read(r.ino, frm)

    def op_copied(self, frm, r):
        self.vfs.copied(r.ino, r.gen, frm)
        return {}

    def op_close(self, frm, r):
        self.vfs.close_write(r.ino, r.gen, frm, r.size, r.mtime_ns, r.ctime_ns, again=r.again)
        return {}

    def op_reopen(self, frm, r):
        self.vfs.reopen_write(r.ino, r.gen, frm)
        return {}

    def op_end_write(self, frm, r):
        self.vfs.end_write(r.ino, r.gen, frm, again=r.again)
        return {}

    def op_end_read(self, frm, r):
        self.vfs.end_read(r.ino, r.gen, frm)
        return {}

    def op_fsync(self, frm, r):
        self.vfs.sync_write(r.ino, r.gen, frm, r.size, r.mtime_ns)
        return {}

    def op_evict(self, frm, r):
        return {"ok": self.vfs.evict(r.ino, r.gen, frm)}

    def op_rejoin(self, frm, r):
        files = {int(ino): (int(gen), int(size)) for ino, gen, size in r.files}
        out = self.vfs.rejoin(frm, files)
        clean, drop = [], []
        with self.meta.lock:
            for ino, (gen, _) in files.items():
                node = self.meta.get(ino)
                if self.meta.gen_pending(ino, gen):
                    continue
                if node is not None and node.gen == gen:
                    if not node.dirty and not node.local and not self.meta.puts_of(ino) \
                            and node.upath is not None:
                        clean.append([ino, gen])
                elif node is not None and gen < node.gen:
                    drop.append([ino, gen])
        out.update(clean=clean, drop=drop)
        return out

    def op_flush(self, frm, r):
        from acache.errors import FlushError
        rel = r.path or ""
        self.meta.begin_barrier()
        try:
            return barrier.wait(self.meta, self.persister, self.cache, self.vfs.writers, rel,
                                r.timeout, None, time.monotonic())
        except FlushError as e:
            # an answer, not an error: the reason has to reach the asking node (an exception
            # here would reach it as a bare EIO), with the nodes whose data it waits for
            return {"ok": False, "error": str(e) + self._waiting_for(rel)}
        finally:
            self.meta.end_barrier()

    def _waiting_for(self, rel: str) -> str:
        with self.meta.lock:
            holders = {e.node for e in self.meta.journal() if e.node and e.touches(rel)}
        try:
            alive = {m.record.id for m in self.member.cluster.members() if m.alive}
        except Exception:                # noqa: BLE001 - only a hint in an error message
            return ""
        down = sorted(holders - alive)
        return (f"; waiting for node {', '.join(down)} (down), which holds unpersisted files"
                if down else "")


    def op_hurry(self, frm, r):
        """``frm``'s writers wait for room in its cache: no flush delay for what is journaled."""
        self.persister.hurry(self.meta.last_seq())
        return {}

    def op_journal(self, frm, r):
        total, entries = self.persister.entries(int(r.limit))
        return {"total": total, "entries": entries}

    def op_journal_skip(self, frm, r):
        try:
            return self.persister.skip(int(r.seq), str(r.reason))
        except AcacheError as e:
            raise FsError(errno.ENOENT, str(e)) from None

    def op_status(self, frm, r):
        """The cluster's persisting: queue, what each holder has unpersisted, and which node
        (if any) blocks it: the holder of the oldest entry when that node is down."""
        meta, p = self.meta, self.persister
        try:
            alive = {m.record.id for m in self.member.cluster.members() if m.alive}
        except MetaError:
            alive = None
        with meta.lock:
            journal = meta.journal()
            held: dict[str, list[int]] = {}
            for e in journal:
                if e.op == "put" and e.node:
                    h = held.setdefault(e.node, [0, 0])
                    h[0] += 1
                    h[1] += e.size
            oldest = journal[0] if journal else None
            blocked = ""
            if oldest is not None and oldest.node and alive is not None and oldest.node not in alive:
                blocked = oldest.node
            if blocked:
                if self._blocked[0] != blocked:
                    self._blocked = (blocked, time.time())
            else:
                self._blocked = ("", 0.0)
            cached_by: dict[str, int] = {}
            files: list[dict] = []           # msgpack maps of the reply
            rel = r.path
            for n in meta.inodes():
                if n.is_dir or n.nlink == 0:
                    continue
                if n.cached and n.node:
                    cached_by[n.node] = cached_by.get(n.node, 0) + 1
                if rel is not None:
                    fp = meta.path_of(n.ino)
                    if barrier.under(fp, rel):
                        files.append({"path": fp, "holder": n.node if n.cached else "",
                                      "size": n.size, "gen": n.gen})
            # files of cacheless writers open for writing, per worker (what placement evens out)
            out: dict[str, object] = {"workers": self.placement.workers(),
                                      "cached_files": cached_by,
                                      "placed_open": dict(self.vfs.placed_load)}
            if rel is not None:
                out["files"] = sorted(files, key=lambda f: f["path"])
            return {**out, "head": self.member.node_id, "queue": len(journal),
                    "queue_bytes": sum(e.size for e in journal),
                    "in_flight": len(p.jobs), "rate": p.rate(), "persisted_bytes": p.bytes_done,
                    "persisted_files": p.files_done, "last_error": p.last_error,
                    "failed": len(p.failed), "blocked_by": blocked,
                    "waits_for_writer": barrier.held_for_writer(journal),
                    "blocked_since": self._blocked[1] if blocked else 0,
                    "blocked_files": len(journal) if blocked else 0,
                    "blocked_bytes": sum(e.size for e in journal) if blocked else 0,
                    "held": held, "began_used": dict(self.edge.began_used),
                    "calls": dict(self.calls),
                    "oldest": ({"seq": oldest.seq, "op": oldest.op, "path": oldest.path,
                                "node": oldest.node} if oldest is not None else None)}
