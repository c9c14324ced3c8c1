"""Errors specific to the NIXL transport; all are kvproto TransportErrors.

``LayoutMismatch`` and ``RegistrationError`` are shared by every transport and
defined once in :mod:`kvproto.transport`; they are re-exported here so that
``from kvproto_transports.nixl.errors import LayoutMismatch`` keeps working.
"""

from __future__ import annotations

from kvproto.transport import LayoutMismatch, RegistrationError, TransportError

__all__ = ["LayoutMismatch", "RegistrationError", "WrongThread"]


class WrongThread(TransportError):
    """A NixlTransport method was called from a thread other than the one that created it.

    NIXL agents are created with ``NIXL_THREAD_SYNC_NONE`` (no internal locks), and
    vLLM itself keeps every NIXL call on one thread ("NIXL is not guaranteed to be
    thread-safe"), so the endpoint refuses instead of racing.
    """
