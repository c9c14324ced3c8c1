"""Errors specific to the Mooncake transport; all are kvproto TransportErrors."""

from __future__ import annotations

from kvproto.transport import TransportError

__all__ = ["Backpressure", "MooncakeUnavailable"]


class MooncakeUnavailable(TransportError):
    """``mooncake.engine`` cannot be imported, or the transfer engine failed to start."""


class Backpressure(TransportError):
    """The peer's notification queue is full (it is not draining); nothing was sent.

    Transient: retry later. The limit is ``MooncakeTransport(max_pending_sends=...)``.
    """
