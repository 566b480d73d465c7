"""Shared bits of the etcd tests: waiting with a deadline, a client that loses replies."""
from __future__ import annotations

import time
from typing import Callable

import grpc

from acache.meta.etcd import EtcdClient


def wait_for(cond: Callable[[], object], timeout: float, what: str, every: float = 0.02):
    """Poll ``cond`` until it is truthy; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


class LostReply(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the reply was lost (test)"


class LossyClient(EtcdClient):
    """An EtcdClient whose next ``drop`` RPCs *are applied* but their replies lost (or every
    ``every``-th one): what a member killed right after committing looks like."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.drop = 0
        self.every = 0
        self.calls = 0
        self.dropped = 0

    def _attempt(self, op, stubs, timeout):
        r = op(stubs, timeout)
        self.calls += 1
        if self.drop > 0 or (self.every and self.calls % self.every == 0):
            self.drop = max(0, self.drop - 1)
            self.dropped += 1
            raise LostReply()
        return r
