"""What travels: ``MooncakeTransport.metadata()`` and the notification frames.

Metadata (msgpack via msgspec, the envelope NIXL and UCX share) carries what
a peer needs to read this endpoint's memory and to send it notifications,
without another round trip: the transfer engine's session name
(``host:rpc_port``, what ``batch_transfer_async_read`` takes), the ZMQ
address of the endpoint's notification socket, the peer id and
incarnation, and the registered layout. Mooncake's TCP and RDMA transports
find the remote buffers by address through their own handshake, so no
remote keys travel.

A notification is one ZMQ multipart message of three frames: the target's
PeerId, the sender's PeerId, the payload unchanged (byte-exact: NUL,
non-UTF-8 and empty payloads included). The receiver drops a message whose
target is not itself (an older incarnation's address reused) or whose shape
is wrong.
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
    layout_to_wire,
)

__all__ = [
    "MAX_PEER_ID_BYTES",
    "WIRE_KIND",
    "WIRE_VERSION",
    "LayoutWire",
    "MooncakeMetadata",
    "decode_frame",
    "decode_metadata",
    "encode_metadata",
    "layout_to_wire",
]

WIRE_KIND = "kvproto-mooncake"
WIRE_VERSION = 1
MAX_PEER_ID_BYTES = 256
"""Longest PeerId a frame may name; longer ones are dropped as malformed."""


class MooncakeMetadata(Envelope, frozen=True):
    """Everything a peer needs to reach and read from one MooncakeTransport endpoint.

    ``kind`` is always :data:`WIRE_KIND`, ``version`` the sender's :data:`WIRE_VERSION`.
    """

    peer: str
    """The endpoint's PeerId (``local_peer``), unique per incarnation."""
    incarnation: int
    """Random 64-bit number drawn when the endpoint was created."""
    session: str
    """The transfer engine's session name, ``host:rpc_port`` (its P2P handshake listener)."""
    notify_address: str
    """ZMQ address of the endpoint's notification socket, ``tcp://host:port``."""
    layout: LayoutWire | None
    """The registered layout, or None before ``register_blocks``."""


_meta_decoder = msgspec.msgpack.Decoder(MooncakeMetadata)


def encode_metadata(meta: MooncakeMetadata) -> bytes:
    """Encode for ``metadata()``."""
    return encode_envelope(meta)


def _check_host_port(value: str, what: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadMetadata(f"{what} {value[:80]!r} is not host:port")


def decode_metadata(data: bytes) -> tuple[MooncakeMetadata, BlockLayout | None]:
    """Decode what ``add_peer`` was given; anything unusable is :class:`BadMetadata`."""
    meta = decode_envelope(
        _meta_decoder, data, kind=WIRE_KIND, version=WIRE_VERSION, label="Mooncake"
    )
    if not meta.peer or len(meta.peer.encode()) > MAX_PEER_ID_BYTES:
        raise BadMetadata("metadata without a usable peer id")
    _check_host_port(meta.session, "session")
    if not meta.notify_address.startswith("tcp://"):
        raise BadMetadata(f"notify address {meta.notify_address[:80]!r} is not tcp://host:port")
    _check_host_port(meta.notify_address[len("tcp://") :], "notify address")
    if meta.layout is None:
        return meta, None
    check_memory_kind(meta.layout)
    return meta, layout_from_metadata(meta.layout)


def decode_frame(parts: list[bytes], local_peer: bytes) -> tuple[str, bytes] | None:
    """``(sender, payload)`` of a received message meant for ``local_peer``, else None."""
    if len(parts) != 3 or parts[0] != local_peer:
        return None
    sender = parts[1]
    if not sender or len(sender) > MAX_PEER_ID_BYTES:
        return None
    try:
        return sender.decode(), parts[2]
    except UnicodeDecodeError:
        return None
