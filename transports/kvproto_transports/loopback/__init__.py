"""In-process, deterministic loopback transport driven by an injected clock.

Quick start::

    from kvproto_transports.loopback import LinkFaults, LoopbackNetwork

    net = LoopbackNetwork(seed=7, detection_delay=0.5)
    p, d = net.endpoint("P"), net.endpoint("D")
    d_id = p.add_peer(d.metadata())
    net.set_link("P", "D", LinkFaults(delay=0.001, drop=0.1))
    p.send(d_id, b"hello")
    net.advance(net.now + 0.001)      # or: net.advance(net.next_event_time())
    d.poll()                           # [Received(peer="P#1", payload=b"hello")] unless dropped

See :mod:`kvproto_transports.loopback.network` for the exact semantics and
:func:`conformance_factory` for how the conformance kit runs it.
"""

from kvproto_transports.loopback.endpoint import (
    DEFAULT_MAX_NOTIFICATION_SIZE,
    LoopbackTransport,
)
from kvproto_transports.loopback.faults import PERFECT, LinkFaults, Links
from kvproto_transports.loopback.kit import LoopbackGroup, conformance_factory
from kvproto_transports.loopback.network import LoopbackNetwork, base_name
from kvproto_transports.loopback.stats import LoopbackStats

__all__ = [
    "DEFAULT_MAX_NOTIFICATION_SIZE",
    "PERFECT",
    "LinkFaults",
    "Links",
    "LoopbackGroup",
    "LoopbackNetwork",
    "LoopbackStats",
    "LoopbackTransport",
    "base_name",
    "conformance_factory",
]
