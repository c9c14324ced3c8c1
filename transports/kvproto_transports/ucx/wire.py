"""What travels: ``UcxTransport.metadata()`` and the frames on a UCX endpoint.

Metadata (msgpack via msgspec) carries everything a peer needs to reach this
endpoint and read its memory without another round trip: the UCX worker
address, the peer id and incarnation, the registered layout and one packed
UCP remote key per region (as NIXL's agent metadata does).

Frames are UCP tagged messages. The 64-bit tag says what the message is and
who sent it: the frame kind in the top byte, the sender's 56-bit random key
below. A notification's message body is the payload itself, unchanged, so
delivery is byte-exact (NUL, non-UTF-8 and empty payloads included); the
kvproto core does its own framing inside it. The first message on every
connection is a HELLO that binds the sender key to the sender's PeerId.
"""

from __future__ import annotations

import enum

import msgspec

from kvproto.tpmath import BlockLayout
from kvproto.transport import BadMetadata
from kvproto_transports.metadata_envelope import (
    Envelope,
    LayoutWire,
    check_memory_kind,
    decode_envelope,
    encode_envelope,
    layout_from_metadata,
    layout_to_wire,
)

__all__ = [
    "KEY_BITS",
    "KEY_MASK",
    "WIRE_KIND",
    "WIRE_VERSION",
    "FrameKind",
    "Hello",
    "LayoutWire",
    "UcxMetadata",
    "decode_hello",
    "decode_metadata",
    "encode_metadata",
    "hello_body",
    "layout_to_wire",
    "make_tag",
    "split_tag",
]

WIRE_KIND = "kvproto-ucx"
WIRE_VERSION = 1


class FrameKind(enum.IntEnum):
    """Top byte of every message tag."""

    HELLO = 1
    """First frame on a connection: who is calling, and whom it means to reach."""
    NOTIFY = 2
    """A notification; the message body is the payload."""
    PROBE = 3
    """Liveness probe, empty; dropped by the receiver. Sent on an idle connection so
    that a dead peer's broken TCP connection is noticed (a socket that is only
    written to is not watched for a reset)."""


KEY_BITS = 56
KEY_MASK = (1 << KEY_BITS) - 1


def make_tag(kind: FrameKind, sender_key: int) -> int:
    """The tag of a frame of ``kind`` from the endpoint whose key is ``sender_key``."""
    return (int(kind) << KEY_BITS) | (sender_key & KEY_MASK)


def split_tag(tag: int) -> tuple[int, int]:
    """``(kind, sender_key)`` of a received tag (kind may be unknown)."""
    return tag >> KEY_BITS, tag & KEY_MASK


class UcxMetadata(Envelope, frozen=True):
    """Everything a peer needs to reach and read from one UcxTransport endpoint.

    ``kind`` is always :data:`WIRE_KIND`, ``version`` the sender's :data:`WIRE_VERSION`.
    """

    peer: str
    """The endpoint's PeerId (``local_peer``), unique per incarnation."""
    incarnation: int
    """Random 64-bit number drawn when the endpoint was created."""
    worker_address: bytes
    """``ucp_worker_get_address``: how UCX reaches this endpoint's worker (no port needed)."""
    layout: LayoutWire | None
    """The registered layout, or None before ``register_blocks``."""
    rkeys: tuple[bytes, ...]
    """One packed UCP remote key per region of ``layout`` (empty without a layout)."""


class Hello(msgspec.Struct, frozen=True, array_like=True):
    """Body of a HELLO frame."""

    sender: str
    """The caller's PeerId."""
    target: str
    """The PeerId the caller means to reach; a listener of another incarnation refuses."""


_hello_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(UcxMetadata)
_hello_decoder = msgspec.msgpack.Decoder(Hello)


def encode_metadata(meta: UcxMetadata) -> bytes:
    """Encode for ``metadata()``."""
    return encode_envelope(meta)


def decode_metadata(data: bytes) -> tuple[UcxMetadata, BlockLayout | None]:
    """Decode what ``add_peer`` was given; anything unusable is :class:`BadMetadata`."""
    meta = decode_envelope(_meta_decoder, data, kind=WIRE_KIND, version=WIRE_VERSION, label="UCX")
    if not meta.peer or not meta.worker_address:
        raise BadMetadata("metadata without a peer id or worker address")
    if meta.layout is None:
        if meta.rkeys:
            raise BadMetadata("remote keys without a layout")
        return meta, None
    check_memory_kind(meta.layout)
    if len(meta.rkeys) != len(meta.layout.region_addrs) or not all(meta.rkeys):
        raise BadMetadata("need one non-empty remote key per region")
    return meta, layout_from_metadata(meta.layout)


def hello_body(sender: str, target: str) -> bytes:
    """The body of a HELLO frame."""
    return _hello_encoder.encode(Hello(sender=sender, target=target))


def decode_hello(body: bytes) -> Hello | None:
    """A HELLO body, or None if it does not decode."""
    try:
        return _hello_decoder.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError):
        # Invalid UTF-8 in a str field is a UnicodeDecodeError, not a DecodeError: left
        # uncaught it ended the UCX engine thread on one bad HELLO (found by fuzz_metadata).
        return None
