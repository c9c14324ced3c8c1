"""The two kinds of protocol error, as in h11 and h2.

* :class:`LocalProtocolError` — the caller misused the API (a bad config, an
  unknown request id, a block outside the layout). It is raised: it is a bug
  in the code that called the core.
* :class:`RemoteProtocolError` — a peer sent something invalid. Parsers raise
  it; the holder and reader state machines catch it, drop the input, count it
  in their stats and never let it escape into the caller's step.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base of both protocol errors."""


class LocalProtocolError(ProtocolError):
    """The local caller broke the API contract."""


class RemoteProtocolError(ProtocolError):
    """A peer sent bytes or a frame that the protocol does not allow."""
