"""Errors specific to the UCX transport; all are kvproto TransportErrors."""

from __future__ import annotations

from kvproto.transport import TransportError


class UcxUnavailable(TransportError):
    """ucxx (``pip install ucxx-cu12``) cannot be imported or UCX failed to start."""


class RegistrationError(TransportError):
    """Memory could not be registered (a second registration, or UCX refused it)."""


class LayoutMismatch(TransportError):
    """The local and remote layouts cannot be paired for this read (regions or lengths differ)."""


class Backpressure(TransportError):
    """Too many sends are queued or in flight on this endpoint; nothing was sent.

    Transient: the peer is alive but not draining (or the endpoint's thread is
    behind). Retry later; the limit is ``UcxTransport(max_pending_sends=...)``.
    """
