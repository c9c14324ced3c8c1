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

from kvproto.errors import LocalProtocolError
from kvproto.tpmath import BlockLayout
from kvproto.transport import BadMetadata

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


class LayoutWire(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A :class:`~kvproto.tpmath.BlockLayout` on the wire."""

    region_addrs: tuple[int, ...]
    """Base address of each region."""
    block_lens: tuple[int, ...]
    """Bytes per block in each region."""
    num_blocks: int
    """Blocks per region."""
    device_id: int
    """Device index of the memory."""
    memory_kind: str
    """``DRAM`` or ``VRAM``."""


class UcxMetadata(msgspec.Struct, frozen=True):
    """Everything a peer needs to reach and read from one UcxTransport endpoint."""

    kind: str
    """Always :data:`WIRE_KIND`; guards against feeding another transport's blob."""
    version: int
    """:data:`WIRE_VERSION` of the sender."""
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


_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(UcxMetadata)
_hello_decoder = msgspec.msgpack.Decoder(Hello)


def layout_to_wire(layout: BlockLayout) -> LayoutWire:
    """Convert a layout for the wire."""
    return LayoutWire(
        region_addrs=layout.region_addrs,
        block_lens=layout.block_lens,
        num_blocks=layout.num_blocks,
        device_id=layout.device_id,
        memory_kind=layout.memory_kind,
    )


def encode_metadata(meta: UcxMetadata) -> bytes:
    """Encode for ``metadata()``."""
    return _meta_encoder.encode(meta)


def decode_metadata(data: bytes) -> tuple[UcxMetadata, BlockLayout | None]:
    """Decode what ``add_peer`` was given; anything unusable is :class:`BadMetadata`."""
    try:
        meta = _meta_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadMetadata(f"not UCX endpoint metadata: {exc}") from exc
    if meta.kind != WIRE_KIND:
        raise BadMetadata(f"metadata is for transport {meta.kind!r}, not {WIRE_KIND!r}")
    if meta.version != WIRE_VERSION:
        raise BadMetadata(f"unsupported UCX metadata version {meta.version}")
    if not meta.peer or not meta.worker_address:
        raise BadMetadata("metadata without a peer id or worker address")
    if meta.layout is None:
        if meta.rkeys:
            raise BadMetadata("remote keys without a layout")
        return meta, None
    wl = meta.layout
    if wl.memory_kind not in ("DRAM", "VRAM"):
        raise BadMetadata(f"unknown memory kind {wl.memory_kind!r}")
    if len(meta.rkeys) != len(wl.region_addrs) or not all(meta.rkeys):
        raise BadMetadata("need one non-empty remote key per region")
    try:
        layout = BlockLayout(
            region_addrs=wl.region_addrs,
            block_lens=wl.block_lens,
            num_blocks=wl.num_blocks,
            device_id=wl.device_id,
            memory_kind=wl.memory_kind,
        )
    except LocalProtocolError as exc:
        raise BadMetadata(f"invalid layout in metadata: {exc}") from exc
    return meta, layout


def hello_body(sender: str, target: str) -> bytes:
    """The body of a HELLO frame."""
    return _meta_encoder.encode(Hello(sender=sender, target=target))


def decode_hello(body: bytes) -> Hello | None:
    """A HELLO body, or None if it does not decode."""
    try:
        return _hello_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
