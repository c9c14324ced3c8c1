"""The part of a transport's ``metadata()`` blob that NIXL and UCX share.

Both blobs are msgpack maps (via msgspec) that start with ``kind`` and
``version`` and carry the registered :class:`~kvproto.tpmath.BlockLayout` as a
:class:`LayoutWire`; each transport adds its own fields (agent metadata, a
worker address and remote keys) in a subclass of :class:`Envelope`. msgspec
encodes a subclass's inherited fields first, under their names, so the bytes
are the same as when each transport spelled all its fields out itself
(``tests/transports/test_metadata_envelope.py`` pins them).
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from kvproto.errors import LocalProtocolError
from kvproto.tpmath import BlockLayout
from kvproto.transport import BadMetadata

MEMORY_KINDS = ("DRAM", "VRAM")
"""Memory kinds a layout on the wire may name."""


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


class Envelope(msgspec.Struct, frozen=True):
    """The leading fields of every transport's metadata blob; subclasses add theirs after."""

    kind: str
    """The transport's wire kind; guards against feeding another transport's blob."""
    version: int
    """The sender's version of that transport's metadata."""


E = TypeVar("E", bound=Envelope)

_encoder = msgspec.msgpack.Encoder()


def layout_to_wire(layout: BlockLayout) -> LayoutWire:
    """Convert a layout for the wire."""
    return LayoutWire(
        region_addrs=layout.region_addrs,
        block_lens=layout.block_lens,
        num_blocks=layout.num_blocks,
        device_id=layout.device_id,
        memory_kind=layout.memory_kind,
    )


def layout_from_wire(wire: LayoutWire) -> BlockLayout:
    """Convert back, re-running the layout's own validation (:class:`LocalProtocolError`)."""
    return BlockLayout(
        region_addrs=wire.region_addrs,
        block_lens=wire.block_lens,
        num_blocks=wire.num_blocks,
        device_id=wire.device_id,
        memory_kind=wire.memory_kind,
    )


def encode_envelope(meta: Envelope) -> bytes:
    """Encode a transport's metadata for ``metadata()``."""
    return _encoder.encode(meta)


def decode_envelope(
    decoder: msgspec.msgpack.Decoder[E], data: bytes, *, kind: str, version: int, label: str
) -> E:
    """Decode ``data`` and check its kind and version; anything unusable is :class:`BadMetadata`.

    ``label`` names the transport in messages (``"NIXL"``, ``"UCX"``).
    """
    try:
        meta = decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # msgspec raises UnicodeDecodeError (not DecodeError) for invalid UTF-8 in a str
        # field; ValidationError is a DecodeError.
        raise BadMetadata(f"not {label} endpoint metadata: {exc}") from exc
    if meta.kind != kind:
        raise BadMetadata(f"metadata is for transport {meta.kind!r}, not {kind!r}")
    if meta.version != version:
        raise BadMetadata(f"unsupported {label} metadata version {meta.version}")
    return meta


def check_memory_kind(wire: LayoutWire) -> None:
    """Refuse a layout whose memory kind no transport knows (:class:`BadMetadata`)."""
    if wire.memory_kind not in MEMORY_KINDS:
        raise BadMetadata(f"unknown memory kind {wire.memory_kind!r}")


def layout_from_metadata(wire: LayoutWire) -> BlockLayout:
    """The layout a peer advertised; an invalid one is :class:`BadMetadata`.

    Call :func:`check_memory_kind` first (transports check their own fields in between).
    """
    try:
        return layout_from_wire(wire)
    except LocalProtocolError as exc:
        raise BadMetadata(f"invalid layout in metadata: {exc}") from exc
