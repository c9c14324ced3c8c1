"""What the scheduler-side connector tells the worker-side one, every step.

vLLM builds one :class:`KvprotoMetadata` per engine step
(``build_connector_meta``) and hands it to every worker rank
(``bind_connector_metadata``); with several worker processes it is pickled,
so everything here is plain data. The lease cores live in the workers (they
own the NIXL agent that heartbeats and done frames arrive at), so the
scheduler only mints tickets and forwards request events.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from kvproto.ticket import LeaseTicket


@dataclass(frozen=True, slots=True, kw_only=True)
class Grant:
    """P: the scheduler delayed freeing a finished request's blocks under this ticket."""

    request_id: str
    """The prefill engine's request id (what finished_sending must name)."""
    ticket: LeaseTicket
    """Minted by the scheduler; every worker rank's Holder adopts it."""
    writable: bool = False
    """Push mode, D: a prefill engine writes the blocks (``Holder.adopt(writable=True)``);
    the lease's end is a load's outcome (:mod:`.push_holder`), not a free."""
    block_ids: list[list[int]] = field(default_factory=list)
    """Push mode, P: the request's blocks per transfer group (clipped), which a decoder
    that registered before this prefill finished is paired with (:mod:`.push_writer`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Track:
    """D: a request carrying a lease ticket entered the scheduler (start heartbeats)."""

    request_id: str
    """The decode engine's request id."""
    ticket: LeaseTicket
    """The holder's ticket from ``kv_transfer_params["kvproto"]``."""
    host: str
    """Holder side-channel host (``remote_host``)."""
    port: int
    """Holder rank 0's side-channel port (``remote_port``); rank r listens on port + r."""
    readers: int = 1
    """How many requests here read the ticket (parallel sampling's children: the
    holder's ``kvproto_readers``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EarlyRegistration:
    """Push mode, D: a request whose prefill engine has not finished yet (a proxy sent it
    to both engines at once): where that engine is, and what it pairs its blocks with
    once it has them (spec/push-mode.md §7)."""

    engine: str
    """The prefill engine's id (``remote_engine_id``)."""
    host: str
    """Its side-channel host (``remote_host``)."""
    port: int
    """Its rank 0's side-channel port; rank r listens on port + r."""
    tp_size: int
    """Its TP size (``tp_size``)."""
    local_groups: list[list[int]]
    """This engine's blocks to fill, per transfer group (the unhashed tail, clipped)."""
    allocated: list[int]
    """Per transfer group, the blocks allocated to the request here (hits included)."""
    block_size: int
    """This engine's tokens per block (the prefill engine's must be equal)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Recv:
    """D: blocks were allocated for a request; read the remote blocks into them."""

    request_id: str
    """The decode engine's request id."""
    local_block_ids: list[int]
    """Local blocks to fill, every KV cache group's (the unhashed tail after a partial
    prefix hit; empty on a full local hit, which only tells the holder it may free)."""
    remote_block_ids: list[int]
    """The holder's blocks paired with them one to one (:func:`.groups.pair_blocks`)."""
    awaiting: bool
    """The request waits in WAITING_FOR_REMOTE_KVS: report finished_recving for it."""
    problem: str | None = None
    """Why nothing can be read (the holder's blocks do not cover ours): the request
    fails at once, its local blocks reported bad, so vLLM recomputes it."""
    ratio: int = 1
    """Holder blocks per local block (the decoder's block size over the holder's)."""
    local_parts: list[int] = field(default_factory=list)
    """With ``ratio > 1``: per pair, which part of its local block the holder block
    fills (the local ids then repeat, one pair per part); empty at ratio 1."""
    filled_block_ids: list[int] = field(default_factory=list)
    """With ``ratio > 1``: every local block the read writes into, once; after the read
    its parts are put in the local page order and the parts not read are zeroed."""
    writable: LeaseTicket | None = None
    """Push mode: the lease this engine granted on ``local_block_ids`` (its ``Grant`` is
    in the same step); the holder is registered and writes them, nothing is read."""
    early: EarlyRegistration | None = None
    """Push mode, registered before the prefill finished: the prefill engine pairs the
    blocks itself (``remote_block_ids`` is empty)."""


@dataclass(slots=True, kw_only=True)
class KvprotoMetadata(KVConnectorMetadata):
    """One step's orders for the worker-side connector."""

    incarnation: int | None = None
    """P: the holder incarnation the scheduler mints tickets under (None on a pure decoder)."""
    grants: list[Grant] = field(default_factory=list)
    """P: new leases to adopt."""
    tracks: list[Track] = field(default_factory=list)
    """D: new requests to heartbeat for."""
    recvs: list[Recv] = field(default_factory=list)
    """D: reads to issue once the holder session is open."""
    finishes: list[str] = field(default_factory=list)
    """D: requests that left the scheduler (finished, aborted, or read and confirmed)."""
    prefills: list[str] = field(default_factory=list)
    """Push mode, P: requests to be decoded elsewhere that entered the scheduler (a
    decoder may register for them before they finish)."""
    dropped: list[str] = field(default_factory=list)
    """Push mode, P: of those, the ones that left it without a grant (aborted, failed):
    nothing will be written for them."""

    def is_empty(self) -> bool:
        """Nothing to do this step (the incarnation alone is not work)."""
        return not (
            self.grants
            or self.tracks
            or self.recvs
            or self.finishes
            or self.prefills
            or self.dropped
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class KvprotoHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at startup (vLLM's handshake-metadata channel)."""

    rank: int
    """The worker's TP rank."""
    stock_payload: bytes | None = None
    """Interop mode: stock's encoded NixlHandshakePayload for this rank, served to stock
    decoders by the scheduler's stock-format listener."""
