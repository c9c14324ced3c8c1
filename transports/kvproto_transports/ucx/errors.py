"""Errors specific to the UCX transport; all are kvproto TransportErrors.

``LayoutMismatch`` and ``RegistrationError`` are shared by every transport and
defined once in :mod:`kvproto.transport`; they are re-exported here so that
``from kvproto_transports.ucx.errors import LayoutMismatch`` keeps working.
"""

from __future__ import annotations

from kvproto.transport import LayoutMismatch, RegistrationError, TransportError

__all__ = ["Backpressure", "LayoutMismatch", "RegistrationError", "UcxUnavailable"]


class UcxUnavailable(TransportError):
    """ucxx (``pip install ucxx-cu12``) cannot be imported or UCX failed to start."""


class Backpressure(TransportError):
    """Too many sends are queued or in flight on this endpoint; nothing was sent.

    Transient: the peer is alive but not draining (or the endpoint's thread is
    behind). Retry later; the limit is ``UcxTransport(max_pending_sends=...)``.
    """
