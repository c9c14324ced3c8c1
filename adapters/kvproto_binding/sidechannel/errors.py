"""Typed handshake failures, as the client reports them."""

from __future__ import annotations

from kvproto.errors import RemoteProtocolError


class MalformedHandshake(RemoteProtocolError):
    """A request or reply body that is not a valid side-channel message (peer input)."""


class SideChannelError(Exception):
    """Base of every side-channel failure."""

    retryable: bool = False
    """Whether trying the same holder again may help."""


class HandshakeTimeout(SideChannelError):
    """No valid reply within the timeout (holder down, unreachable, or overloaded)."""

    retryable = True


class BadReply(SideChannelError):
    """The reply could not be decoded or did not answer our request."""

    retryable = True


class CompatMismatch(SideChannelError):
    """The holder's compat hash differs from ours: its KV cache is not usable by us."""

    def __init__(self, *, ours: bytes, theirs: bytes) -> None:
        super().__init__(
            f"compat hash mismatch: ours {ours.hex()[:16]}, theirs {theirs.hex()[:16]}"
        )
        self.ours = ours
        """Our compat hash."""
        self.theirs = theirs
        """The holder's compat hash."""


class AuthenticationFailed(SideChannelError):
    """The shared-secret MAC was missing or wrong (on the reply, or the holder refused ours)."""


class ServerRefused(SideChannelError):
    """The holder answered with an error code (see :mod:`.wire` ``ERR_*``)."""

    def __init__(self, code: str, detail: str = "") -> None:
        super().__init__(f"holder refused: {code}{': ' + detail if detail else ''}")
        self.code = code
        """The error code the holder sent."""
        # A rank whose metadata is not published yet may appear shortly.
        self.retryable = code == "unknown-rank"


class CircuitOpen(SideChannelError):
    """Recent handshakes to this holder all failed; not tried again before ``retry_after_s``."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"circuit open for {retry_after_s:.2f} s more")
        self.retry_after_s = retry_after_s
        """Seconds until the breaker lets one trial through."""


class ClientClosed(SideChannelError):
    """The client was closed while the handshake was pending."""
