"""Push mode's registration: what a decoder rank tells the prefill ranks that write to it.

D grants a writable lease on the blocks it allocated for a remote-prefill request and
sends this, msgpack-encoded, on each writing P rank's side channel (a handshake request's
``registration``, spec/push-mode.md §7). P tracks the ticket with ``writes=True`` and
writes ``writer_blocks`` into ``holder_blocks``, pair by pair (into a part of each where
D's blocks are larger). Peer data: decoding is
total (None for anything malformed), and the core judges the ticket.
"""

from __future__ import annotations

import msgspec

from kvproto.ticket import LeaseTicket


class Registration(msgspec.Struct, frozen=True, kw_only=True):
    """One decoder rank's blocks to be written, under its writable lease."""

    ticket: LeaseTicket
    """D's writable lease on ``holder_blocks`` (holder: the decoder engine)."""
    writer_request_id: str
    """P's request id (its prefill lease's ``request_id``): whose blocks are written."""
    host: str
    """D's side-channel host, where P's reader handshakes with D's ranks."""
    port: int
    """D's rank-0 side-channel port (rank r: + r)."""
    holder_blocks: list[int]
    """D's blocks, the write's destinations."""
    writer_blocks: list[int]
    """P's blocks, one per destination (the tail D's prefix cache lacks)."""
    parts: int = 1
    """P's blocks per D block (D's block size over P's): each P block fills one part."""
    holder_parts: list[int] = []
    """With ``parts > 1``: per pair, the part of its D block that P's block fills (D's
    block ids then repeat, one pair per part); empty at 1."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Registration)


def encode_registration(registration: Registration) -> bytes:
    """msgpack bytes of ``registration``."""
    return _encoder.encode(registration)


def decode_registration(data: bytes) -> Registration | None:
    """The registration in ``data``, or None if it is not a well-formed one."""
    try:
        reg = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return None
    pairs_ok = len(reg.holder_blocks) == len(reg.writer_blocks) and reg.holder_blocks
    ids_ok = all(b >= 0 for b in (*reg.holder_blocks, *reg.writer_blocks))
    if not (pairs_ok and ids_ok and reg.writer_request_id and 0 < reg.port < 65536):
        return None
    if reg.parts == 1:
        return reg if not reg.holder_parts else None
    parts_ok = len(reg.holder_parts) == len(reg.holder_blocks) and all(
        0 <= part < reg.parts for part in reg.holder_parts
    )
    return reg if reg.parts > 1 and parts_ok else None
