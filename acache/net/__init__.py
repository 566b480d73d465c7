"""Peer networking: the Transport seam (transport.py), TCP (tcp.py), RDMA (rdma.py)."""


def transport_from_settings(settings, **kw):
    """The peer transport of ``settings.transport`` (auto | tcp | rdma): an RdmaTransport,
    which negotiates RDMA per peer and uses TCP where it cannot; pyverbs is imported only on a
    host that lists an RDMA device.  ``transport = rdma`` without one is a ConfigError."""
    from acache.net.rdma import RdmaTransport
    return RdmaTransport.from_settings(settings, **kw)
