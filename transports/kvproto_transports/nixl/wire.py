"""What ``NixlTransport.metadata()`` carries: NIXL agent metadata plus the KV layout.

The layout travels with the agent metadata (as vLLM's ``NixlAgentMetadata``
carries ``kv_caches_base_addr``/``block_lens``/``num_blocks``) so that a reader
can build the remote descriptor list without another round trip.
"""

from __future__ import annotations

import msgspec

from kvproto.errors import LocalProtocolError
from kvproto.tpmath import BlockLayout
from kvproto.transport import BadMetadata

WIRE_KIND = "kvproto-nixl"
WIRE_VERSION = 1


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


class EndpointMetadata(msgspec.Struct, frozen=True):
    """Everything a peer needs to reach and read from one NixlTransport endpoint."""

    kind: str
    """Always :data:`WIRE_KIND`; guards against feeding another transport's blob."""
    version: int
    """:data:`WIRE_VERSION` of the sender."""
    agent_name: str
    """NIXL agent name: the endpoint's PeerId, unique per incarnation."""
    agent_metadata: bytes
    """``nixl_agent.get_agent_metadata()``: connection info and memory keys."""
    layout: LayoutWire | None
    """The registered layout, or None before ``register_blocks``."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EndpointMetadata)


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
    """Convert back, re-running the layout's own validation."""
    return BlockLayout(
        region_addrs=wire.region_addrs,
        block_lens=wire.block_lens,
        num_blocks=wire.num_blocks,
        device_id=wire.device_id,
        memory_kind=wire.memory_kind,
    )


def encode_metadata(meta: EndpointMetadata) -> bytes:
    """Encode for ``metadata()``."""
    return _encoder.encode(meta)


def decode_metadata(data: bytes) -> tuple[EndpointMetadata, BlockLayout | None]:
    """Decode what ``add_peer`` was given; anything unusable is :class:`BadMetadata`."""
    try:
        meta = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadMetadata(f"not NIXL endpoint metadata: {exc}") from exc
    if meta.kind != WIRE_KIND:
        raise BadMetadata(f"metadata is for transport {meta.kind!r}, not {WIRE_KIND!r}")
    if meta.version != WIRE_VERSION:
        raise BadMetadata(f"unsupported NIXL metadata version {meta.version}")
    if not meta.agent_name or not meta.agent_metadata:
        raise BadMetadata("metadata without an agent name or agent metadata")
    if meta.layout is None:
        return meta, None
    if meta.layout.memory_kind not in ("DRAM", "VRAM"):
        raise BadMetadata(f"unknown memory kind {meta.layout.memory_kind!r}")
    try:
        return meta, layout_from_wire(meta.layout)
    except LocalProtocolError as exc:
        raise BadMetadata(f"invalid layout in metadata: {exc}") from exc
