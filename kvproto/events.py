"""What the core asks its binding to do, and what it tells it.

The holder and the reader never act: they return these frozen records from
``drain()``, and the binding carries them out (sends the bytes, frees the
blocks, fails the request so it is recomputed).
"""

from __future__ import annotations

import enum

import msgspec

from kvproto.tpmath import BlockSlice
from kvproto.transport import PeerId


class ReleaseReason(enum.IntEnum):
    """Why a holder let a lease go (also the wire value in Revoke frames)."""

    DONE = 1
    """Every expected consumer reported its read done."""
    EXPIRED = 2
    """No heartbeat kept the lease alive past its deadline."""
    ABORTED = 3
    """The reader's request was aborted or rejected; nobody will read."""
    REVOKED = 4
    """The holder's owner revoked it (memory pressure)."""
    MAX_HOLD = 5
    """The lease reached the hard cap on hold time."""
    PEER_LOST = 6
    """The transport reported every reader of the lease gone."""


class FailReason(enum.Enum):
    """Why a reader must not use (or must stop waiting for) the remote blocks."""

    LEASE_LOST = "lease-lost"
    """The holder says it does not hold the lease (expired, unknown, another owner)."""
    REVOKED = "revoked"
    """The holder revoked the lease or it hit max_hold."""
    HOLDER_RESTARTED = "holder-restarted"
    """The holder engine is a new incarnation: the blocks are gone."""
    DEADLINE_TOO_CLOSE = "deadline-too-close"
    """The lease might end before a read could finish; the read was not started."""
    FENCED_LATE = "fenced-late"
    """The holder answered LATE to the done: the read may have overlapped a free."""
    FENCED_NO_ACK = "fenced-no-ack"
    """No answer to the done within ack_timeout: the read cannot be trusted."""
    REFUSED = "refused"
    """The holder refused the done (bad proof, another owner)."""
    READ_FAILED = "read-failed"
    """The transport reported the read failed."""
    CONNECT_FAILED = "connect-failed"
    """The holder could not be reached."""
    BAD_TICKET = "bad-ticket"
    """The ticket is unusable (wrong TP layout, expired before arrival)."""
    NOT_ARMED = "not-armed"
    """Push mode: the holder did not answer the writer's Arm within ``ack_timeout``;
    nothing was written."""


class SendFrame(msgspec.Struct, frozen=True, kw_only=True):
    """Send ``payload`` to ``peer`` as one notification."""

    peer: PeerId
    """Destination."""
    payload: bytes
    """The frame, already encoded and sized to the transport's limit."""


class FreeBlocks(msgspec.Struct, frozen=True, kw_only=True):
    """Holder: the lease ended; the blocks may be reused now."""

    lease: int
    """Lease id."""
    request_id: str
    """The holder's request id the blocks belong to."""
    reason: ReleaseReason
    """Why."""


class WriteFenced(msgspec.Struct, frozen=True, kw_only=True):
    """Holder, writable lease (push mode): it ended while a writer may still write into
    its blocks. The request must not use them (it recomputes), and the blocks must not
    be reused until the ``FreeBlocks`` of the same lease, which follows once no write can
    land any more (spec/push-mode.md §3)."""

    lease: int
    """Lease id."""
    request_id: str
    """The holder's request id the blocks belong to."""
    reason: ReleaseReason
    """Why the lease ended; its ``FreeBlocks`` repeats it."""


class Connect(msgspec.Struct, frozen=True, kw_only=True):
    """Reader: make ``(engine, rank)`` reachable, then call ``reader.connected``."""

    engine: str
    """Holder engine id."""
    rank: int
    """Holder TP rank."""


class RequestFailed(msgspec.Struct, frozen=True, kw_only=True):
    """Reader: the request cannot use the remote blocks; recompute it."""

    request_id: str
    """The reader's request id."""
    reason: FailReason
    """Why."""


class ReadConfirmed(msgspec.Struct, frozen=True, kw_only=True):
    """Reader: every holder rank confirmed the lease was held through the read."""

    request_id: str
    """The reader's request id; its loaded blocks are safe to use."""


class ReadOrder(msgspec.Struct, frozen=True, kw_only=True):
    """One transfer a reader rank must issue for a request (one per holder rank)."""

    holder_rank: int
    """Holder TP rank to read from."""
    peer: PeerId
    """That rank's transport peer."""
    notify: bytes
    """The done frame to attach to the read (arrives after the data); empty when a
    sibling's read of the same lease carries it (:class:`kvproto.reader_session.Fanout`)."""
    local_slice: BlockSlice
    """Which part of each local block this read fills."""
    remote_slice: BlockSlice
    """Which part of each remote block this read takes."""
    carries_data: bool = True
    """False: read no block from this rank, only deliver ``notify`` (the transport's
    notify-only read). Replicated KV (MLA) is read from one holder rank; the others
    still get the done they count (:func:`kvproto.tpmath.part_slices`)."""


class ReadGo(msgspec.Struct, frozen=True, kw_only=True):
    """Reader: start these transfers now."""

    orders: tuple[ReadOrder, ...]
    """One per holder rank this reader rank reads from."""


class ReadDeclined(msgspec.Struct, frozen=True, kw_only=True):
    """Reader: do not read; the request was failed with ``reason`` (see RequestFailed)."""

    reason: FailReason
    """Why the read was not started."""


class ReadDeferred(msgspec.Struct, frozen=True, kw_only=True):
    """Reader: do not read yet; the lease was renewed early, ask again on a later step.

    The deadline bound was within ``read_margin`` only because no heartbeat was
    acknowledged lately (a long forward step), not because the lease is known to
    be ending: the reader sent the session's heartbeat at once. Call
    ``begin_read`` again on a later step (it answers ``ReadGo`` once the
    acknowledgement moved the bound, or ``ReadDeclined``); if the holder has not
    answered by ``until`` the reader fails the request itself
    (``RequestFailed(DEADLINE_TOO_CLOSE)``), exactly as an immediate decline would.
    A request is deferred at most once.
    """

    until: float
    """Local time after which retrying is pointless: without an answer by then the
    request is failed (``now + ack_timeout`` when the read was deferred)."""
    heartbeats: int
    """Heartbeat frames sent early for this deferral (0 when a heartbeat of the same
    session sent at this same instant already covers it)."""


HolderOutput = SendFrame | FreeBlocks | WriteFenced
ReaderOutput = SendFrame | Connect | RequestFailed | ReadConfirmed
