"""Push mode's registration: what a decoder rank tells the prefill ranks that write to it.

D grants a writable lease on the blocks it allocated for a remote-prefill request and
sends this, msgpack-encoded, on each writing P rank's side channel (a handshake request's
``registration``, spec/push-mode.md §7). P tracks the ticket with ``writes=True`` and
writes ``writer_blocks`` into ``holder_blocks``, pair by pair (into a part of each where
D's blocks are larger). An *early* registration, sent before P's prefill finished (a proxy
sent the request to both engines at once), names no pairs: it carries D's blocks per KV
cache group, which P pairs with its own once it has them. Peer data: decoding is
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
    holder_groups: list[list[int]] = []
    """Early: D's blocks to fill per transfer group (``holder_blocks`` and
    ``writer_blocks`` are then empty, and ``writer_request_id`` is P's request's
    external id, :func:`external_id`)."""
    allocated: list[int] = []
    """Early: per transfer group, the blocks allocated to the request on D (hits
    included), which P's pairing trims its own lists to."""
    block_size: int = 0
    """Early: D's tokens per block (P's must be equal)."""

    @property
    def early(self) -> bool:
        """Sent before P's prefill finished: P pairs the blocks."""
        return bool(self.holder_groups)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Registration)


def encode_registration(registration: Registration) -> bytes:
    """msgpack bytes of ``registration``."""
    return _encoder.encode(registration)


def external_id(request_id: str) -> str:
    """A request's id as both engines of a pair know it: vLLM appends 8 random characters
    to the id the client (or the proxy's ``X-Request-Id``) gave (``input_processor.py``:
    ``f"{external}-{random_uuid():.8}"``), each engine its own."""
    head, sep, tail = request_id.rpartition("-")
    return head if sep and head and len(tail) == 8 else request_id


def decode_registration(data: bytes) -> Registration | None:
    """The registration in ``data``, or None if it is not a well-formed one."""
    try:
        reg = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return None
    if reg.holder_groups or reg.allocated:
        return reg if _early_ok(reg) else None
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


def _early_ok(reg: Registration) -> bool:
    """An early registration: D's groups and allocation, no pairs, no parts."""
    return (
        not reg.holder_blocks
        and not reg.writer_blocks
        and not reg.holder_parts
        and reg.parts == 1
        and len(reg.allocated) == len(reg.holder_groups)
        and any(reg.holder_groups)
        and all(b >= 0 for group in reg.holder_groups for b in group)
        and all(n >= len(group) for n, group in zip(reg.allocated, reg.holder_groups, strict=True))
        and reg.block_size >= 0
        and bool(reg.writer_request_id)
        and 0 < reg.port < 65536
    )
