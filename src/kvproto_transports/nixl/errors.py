"""Errors specific to the NIXL transport; all are kvproto TransportErrors."""

from __future__ import annotations

from kvproto.transport import TransportError


class WrongThread(TransportError):
    """A NixlTransport method was called from a thread other than the one that created it.

    NIXL agents are created with ``NIXL_THREAD_SYNC_NONE`` (no internal locks), and
    vLLM itself keeps every NIXL call on one thread ("NIXL is not guaranteed to be
    thread-safe"), so the endpoint refuses instead of racing.
    """


class RegistrationError(TransportError):
    """Memory could not be registered (a second registration, or NIXL refused it)."""


class LayoutMismatch(TransportError):
    """The local and remote layouts cannot be paired for this read (regions or lengths differ)."""
