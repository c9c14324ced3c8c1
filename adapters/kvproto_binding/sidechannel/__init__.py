"""The ZMQ handshake side channel, transport-agnostic (NIXL and UCX both use it).

The holder runs a :class:`SideChannelServer` (ROUTER on ``host:base_port +
dp_rank``) that serves, per rank, opaque transport metadata bytes together
with a compat hash and its monotonic clock. The reader uses a
:class:`HandshakeClient` (concurrent, non-blocking, with backoff and circuit
breakers) or the synchronous :func:`fetch_metadata`. Optionally the reader
introduces itself with its own transport metadata, so the holder can reach
it back (acknowledgements, liveness probes).
"""

from __future__ import annotations

from .breaker import CircuitBreaker
from .client import (
    ClockSample,
    HandshakeClient,
    HandshakeFailed,
    HandshakeResult,
    HandshakeSucceeded,
    MetadataReply,
    fetch_metadata,
)
from .errors import (
    AuthenticationFailed,
    BadReply,
    CircuitOpen,
    ClientClosed,
    CompatMismatch,
    HandshakeTimeout,
    ServerRefused,
    SideChannelError,
)
from .server import Introduction, ServerStats, SideChannelServer

__all__ = [
    "AuthenticationFailed",
    "BadReply",
    "CircuitBreaker",
    "CircuitOpen",
    "ClientClosed",
    "ClockSample",
    "CompatMismatch",
    "HandshakeClient",
    "HandshakeFailed",
    "HandshakeResult",
    "HandshakeSucceeded",
    "HandshakeTimeout",
    "Introduction",
    "MetadataReply",
    "ServerRefused",
    "ServerStats",
    "SideChannelError",
    "SideChannelServer",
    "fetch_metadata",
]
