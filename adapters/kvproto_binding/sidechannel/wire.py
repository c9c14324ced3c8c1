"""Side-channel messages (msgpack via msgspec) and their optional HMAC.

ZMQ frames, client (DEALER, REQ-compatible envelope) to server (ROUTER)::

    [b"", request_body]               # no shared secret
    [b"", request_body, mac]          # mac = HMAC-SHA256(secret, b"kvproto-sc-req" + body)

and back ``[b"", reply_body(, mac)]`` with the ``b"kvproto-sc-rep"`` label. The
reply echoes the request's random nonce, so a recorded reply cannot answer a
later request. Without a secret the channel is unauthenticated, like vLLM's.
"""

from __future__ import annotations

import hashlib
import hmac
import math

import msgspec

from .errors import MalformedHandshake

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 256 * 1024
"""Largest request body the server decodes; larger frames are dropped."""

KIND_GET_META = "get_meta"

ERR_MALFORMED = "malformed"
ERR_UNAUTHENTICATED = "unauthenticated"
ERR_UNKNOWN_RANK = "unknown-rank"
ERR_COMPAT = "compat-mismatch"
ERR_VERSION = "bad-version"
ERR_KIND = "unknown-kind"

_REQ_LABEL = b"kvproto-sc-req"
_REP_LABEL = b"kvproto-sc-rep"


class HandshakeRequest(msgspec.Struct, frozen=True):
    """What a reader asks a holder for."""

    version: int
    """:data:`PROTOCOL_VERSION` of the requester."""
    kind: str
    """:data:`KIND_GET_META`."""
    rank: int
    """Which holder rank's transport metadata is wanted."""
    requester: str
    """Who asks (engine id / transport peer id), for logs and introductions."""
    nonce: bytes
    """16 random bytes, echoed in the reply."""
    compat_hash: bytes = b""
    """The requester's compat hash, so the holder can count mismatches."""
    requester_metadata: bytes = b""
    """The requester's own transport metadata, so the holder can reach it back."""
    registration: bytes = b""
    """Opaque bytes for the holder's owner, queued with the introduction (push mode: a
    decoder's writable ticket and block ids for the prefill engine that writes them)."""


class HandshakeReply(msgspec.Struct, frozen=True):
    """The holder's answer."""

    nonce: bytes
    """The request's nonce."""
    ok: bool
    """False: ``error`` says why and ``metadata`` is empty."""
    rank: int
    """The rank answered for."""
    compat_hash: bytes
    """The holder's compat hash (protocol version, lease parameters, model...)."""
    metadata: bytes
    """The transport metadata of ``rank``."""
    server_time: float
    """The holder's monotonic clock while answering (for min-RTT skew estimation)."""
    error: str = ""
    """An ``ERR_*`` code when ``ok`` is False."""
    detail: str = ""
    """Free text for logs."""


_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(HandshakeRequest)
reply_decoder = msgspec.msgpack.Decoder(HandshakeReply)


def decode_request(body: bytes) -> HandshakeRequest:
    """A request, or :class:`~.errors.MalformedHandshake` (a ``RemoteProtocolError``)."""
    try:
        return request_decoder.decode(body)
    # Invalid UTF-8 in a string field raises UnicodeDecodeError (a ValueError), not
    # DecodeError: found by fuzz/fuzz_handshake.py.
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise MalformedHandshake(f"not a handshake request: {exc}") from None


def decode_reply(body: bytes) -> HandshakeReply:
    """A reply, or :class:`~.errors.MalformedHandshake` (a ``RemoteProtocolError``)."""
    try:
        reply = reply_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise MalformedHandshake(f"not a handshake reply: {exc}") from None
    if not math.isfinite(reply.server_time):
        # NaN defeats every comparison made with it (found by fuzz/fuzz_handshake.py).
        raise MalformedHandshake("non-finite server_time")
    return reply


def encode(message: HandshakeRequest | HandshakeReply) -> bytes:
    """msgpack bytes of a message."""
    return _encoder.encode(message)


def request_mac(secret: bytes, body: bytes) -> bytes:
    """MAC of a request body."""
    return hmac.new(secret, _REQ_LABEL + body, hashlib.sha256).digest()


def reply_mac(secret: bytes, body: bytes) -> bytes:
    """MAC of a reply body."""
    return hmac.new(secret, _REP_LABEL + body, hashlib.sha256).digest()


def mac_ok(expected: bytes, given: bytes | None) -> bool:
    """Constant-time comparison."""
    return given is not None and hmac.compare_digest(expected, given)
