"""What ``NixlTransport.metadata()`` carries: NIXL agent metadata plus the KV layout.

The layout travels with the agent metadata (as vLLM's ``NixlAgentMetadata``
carries ``kv_caches_base_addr``/``block_lens``/``num_blocks``) so that a reader
can build the remote descriptor list without another round trip. The envelope
(kind, version, layout) is shared with the UCX transport:
:mod:`kvproto_transports.metadata_envelope`.
"""

from __future__ import annotations

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
    layout_from_wire,
    layout_to_wire,
)

__all__ = [
    "WIRE_KIND",
    "WIRE_VERSION",
    "EndpointMetadata",
    "LayoutWire",
    "decode_metadata",
    "encode_metadata",
    "layout_from_wire",
    "layout_to_wire",
]

WIRE_KIND = "kvproto-nixl"
WIRE_VERSION = 1


class EndpointMetadata(Envelope, frozen=True):
    """Everything a peer needs to reach and read from one NixlTransport endpoint.

    ``kind`` is always :data:`WIRE_KIND`, ``version`` the sender's :data:`WIRE_VERSION`.
    """

    agent_name: str
    """NIXL agent name: the endpoint's PeerId, unique per incarnation."""
    agent_metadata: bytes
    """``nixl_agent.get_agent_metadata()``: connection info and memory keys."""
    layout: LayoutWire | None
    """The registered layout, or None before ``register_blocks``."""


_decoder = msgspec.msgpack.Decoder(EndpointMetadata)


def encode_metadata(meta: EndpointMetadata) -> bytes:
    """Encode for ``metadata()``."""
    return encode_envelope(meta)


def decode_metadata(data: bytes) -> tuple[EndpointMetadata, BlockLayout | None]:
    """Decode what ``add_peer`` was given; anything unusable is :class:`BadMetadata`."""
    meta = decode_envelope(_decoder, data, kind=WIRE_KIND, version=WIRE_VERSION, label="NIXL")
    if not meta.agent_name or not meta.agent_metadata:
        raise BadMetadata("metadata without an agent name or agent metadata")
    if meta.layout is None:
        return meta, None
    check_memory_kind(meta.layout)
    return meta, layout_from_metadata(meta.layout)
