"""Stock vLLM NixlConnector text frames, read and written totally.

vLLM (lease protocol v4/v5) sends two kinds of NIXL notification:

* heartbeat: ``b"HB:" + b",".join(remote_request_ids)``
* completion: ``f"{remote_request_id}:{expected_consumers}"``

and parses them with ``startswith("HB:")`` / ``rsplit(":", 1)``, which raises
on non-UTF-8 or non-integer input and misparses ids containing ``,``. Here
both directions are total: :func:`parse` returns a frame or raises
:class:`~kvproto.errors.RemoteProtocolError`, and the encoders refuse ids
that the stock parser would misread (:class:`~kvproto.errors.LocalProtocolError`).
These frames carry no token, sender identity or sequence number: a holder
accepts them only when configured to (``accept_legacy``), see spec/threat-model.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvproto.errors import LocalProtocolError, RemoteProtocolError

HB_PREFIX = b"HB:"
MAX_CONSUMERS = 1 << 16
_MAX_COUNT_DIGITS = len(str(MAX_CONSUMERS))


@dataclass(frozen=True, slots=True, kw_only=True)
class LegacyHeartbeat:
    """``HB:id1,id2,...``: renew these requests' leases."""

    request_ids: tuple[str, ...]
    """The holder's request ids (vLLM ``remote_request_id``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LegacyDone:
    """``id:n``: one consumer finished; ``n`` consumers are expected in all."""

    request_id: str
    """The holder's request id."""
    expected: int
    """Number of consumers the reader says to expect."""


LegacyFrame = LegacyHeartbeat | LegacyDone


def parse(data: bytes) -> LegacyFrame:
    """Parse one stock-vLLM notification, or raise RemoteProtocolError."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise RemoteProtocolError("legacy frame is not UTF-8") from None
    if text.startswith("HB:"):
        body = text[3:]
        ids = tuple(body.split(",")) if body else ()
        if any(not i for i in ids):
            raise RemoteProtocolError("empty request id in legacy heartbeat")
        return LegacyHeartbeat(request_ids=ids)
    request_id, sep, count = text.rpartition(":")
    if not sep or not request_id:
        raise RemoteProtocolError("legacy completion needs 'id:n'")
    if not count.isascii() or not count.isdigit():
        raise RemoteProtocolError("legacy completion count is not a decimal integer")
    if len(count) > _MAX_COUNT_DIGITS:
        # Also keeps int() below its 4300-digit limit, past which it raises ValueError.
        raise RemoteProtocolError("legacy completion count is too long")
    expected = int(count)
    if not 1 <= expected <= MAX_CONSUMERS:
        raise RemoteProtocolError(f"legacy completion count {expected} out of range")
    return LegacyDone(request_id=request_id, expected=expected)


def _check_id(request_id: str) -> None:
    # "HB" alone is refused too: its completion frame "HB:n" reads as a heartbeat.
    if not request_id or "," in request_id or request_id.startswith("HB:") or request_id == "HB":
        raise LocalProtocolError(f"request id {request_id!r} cannot travel in a legacy frame")
    try:
        request_id.encode("utf-8")
    except UnicodeEncodeError:
        raise LocalProtocolError(f"request id {request_id!r} is not encodable as UTF-8") from None


def encode_heartbeat(request_ids: Iterable[str]) -> bytes:
    """``HB:a,b,c``; ids with ',', a leading 'HB:', or not UTF-8-encodable are refused."""
    ids = list(request_ids)
    for i in ids:
        _check_id(i)
    return HB_PREFIX + ",".join(ids).encode()


def encode_done(request_id: str, expected: int) -> bytes:
    """``id:n``."""
    _check_id(request_id)
    if not 1 <= expected <= MAX_CONSUMERS:
        raise LocalProtocolError(f"expected consumers {expected} out of range")
    return f"{request_id}:{expected}".encode()
