"""The reader's writer side (push mode): arm, write, and hold an abort back while writing.

In push mode the reader *writes* the holder's blocks (spec/push-mode.md). A request
tracked with ``writes=True`` renews its lease like any other; right before its write
it asks every holder rank to arm the write fence (``Arm``, answered ``ArmAck``), and it
writes only armed, with the deadline bound past the margin. While a write is in flight
no abort of its lease may leave (it could overtake the data and let the holder reuse
the blocks under it): the abort waits for the transport's report, and leaves only if
the write failed. :class:`ReaderWrites` is a part of :class:`~kvproto.reader.Reader`
(its base class); it is apart because it is push mode's concern alone.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvproto import bounds, wire
from kvproto.errors import LocalProtocolError
from kvproto.events import FailReason, ReadDeclined, ReadDeferred, ReadGo, ReadOrder, SendFrame
from kvproto.reader_dones import done_frame
from kvproto.reader_requests import UNKNOWN_WAKE, Request, find_part
from kvproto.states import ReadInput, ReadState, SessionState, read_next

if TYPE_CHECKING:
    from kvproto.config import LeaseConfig
    from kvproto.events import ReaderOutput
    from kvproto.reader_peers import HolderSessions
    from kvproto.reader_requests import SessionKey
    from kvproto.reader_session import Session
    from kvproto.stats import ReaderStats

_UNKNOWN = UNKNOWN_WAKE
_OPEN = SessionState.OPEN
_ON_BEGIN_WRITE = ReadInput.BEGIN_WRITE
_ON_ARM = ReadInput.ARM
_ON_ARM_ACKED = ReadInput.ARM_ACKED
_ARMING = ReadState.ARMING
_ARMED = ReadState.ARMED
_MAY_WRITE = frozenset({ReadState.CLAIMED, _ARMING, _ARMED})
"""Parts of a write request in these states may go on to their write (``begin_write``)."""


class ReaderWrites:
    """The writer's methods of :class:`~kvproto.reader.Reader`. See the module docstring."""

    if TYPE_CHECKING:
        config: LeaseConfig
        stats: ReaderStats
        _wake: float
        _drift: float
        _requests: dict[str, Request]
        _sessions: dict[SessionKey, Session]
        _holders: HolderSessions
        _out: list[ReaderOutput]
        _held_aborts: dict[tuple[str, int], tuple[str, int, bytes]]

        def _get(self, request_id: str) -> Request: ...
        def ready_to_read(self, request_id: str) -> bool: ...
        def _declined_after_failure(
            self, req: Request, reason: FailReason, event: ReadInput
        ) -> ReadDeclined: ...
        def _deadline_bound(self, req: Request, rank: int, now: float) -> float: ...
        def _decline(self, now: float, req: Request) -> None: ...
        def _fail(self, now: float, req: Request, reason: FailReason) -> None: ...
        def _order(self, req: Request, session: Session, rank: int, notify: bytes) -> ReadOrder: ...
        def read_completed(self, now: float, request_id: str, holder_rank: int) -> None: ...
        def read_failed(self, now: float, request_id: str, holder_rank: int) -> None: ...

    def write_ready(self, request_id: str) -> bool:
        """A ``writes=True`` request may go on to its write (:meth:`begin_write`): every
        holder rank it writes to has an open session and acknowledged its claim.

        An id not tracked is misuse (:class:`LocalProtocolError`; ask :meth:`is_tracked`).
        """
        req = self._get(request_id)
        return self.ready_to_read(request_id) and all(
            p.state in _MAY_WRITE for p in req.parts.values()
        )

    def begin_write(self, now: float, request_id: str) -> ReadGo | ReadDeferred | ReadDeclined:
        """Decide whether to write a ``writes=True`` request now (push mode).

        A write goes only armed (spec/push-mode.md, W2): the first call sends an Arm to
        every holder rank and answers ``ReadDeferred``; call again on a later step.
        Once every rank answered armed, ``ReadGo`` lists one WRITE per holder rank, each
        with the done to attach (the holder must receive it only after the data
        landed). Declined, and the request failed: when the lower bound on the holder's
        deadline is within ``read_margin`` (no deferral: the claim renews it), when no
        ArmAck came within ``ack_timeout`` (``NOT_ARMED``), or, through the request's
        failure, when a holder rank refused the Arm (``LEASE_LOST``). A request that
        failed meanwhile is declined as :meth:`begin_read` declines it. Misuse
        (:class:`LocalProtocolError`): an id not tracked, one tracked without
        ``writes``, or one not :meth:`write_ready` (its claim not acknowledged).
        """
        self._wake = _UNKNOWN
        req = self._get(request_id)
        if not req.writes:
            raise LocalProtocolError(f"request {request_id!r} was not tracked to write")
        if req.fail_reason is not None:
            return self._declined_after_failure(req, req.fail_reason, _ON_BEGIN_WRITE)
        if not self.write_ready(request_id):
            raise LocalProtocolError(
                f"request {request_id!r} may not write yet: a claim is not acknowledged"
            )
        margin = bounds.read_margin(self.config.read_margin, req.ticket)
        if any(now + margin >= self._deadline_bound(req, r, now) for r in req.parts):
            self._decline(now, req)
            return ReadDeclined(reason=FailReason.DEADLINE_TOO_CLOSE)
        if any(p.state is not _ARMED for p in req.parts.values()):
            return self._arm(now, req)
        orders = []
        for rank, part in req.parts.items():
            session = self._sessions[(req.ticket.holder_engine, rank)]
            part.state = read_next(part.state, _ON_BEGIN_WRITE)
            part.done_frame = done_frame(req, session.up)
            part.writing = True
            orders.append(self._order(req, session, rank, part.done_frame))
        self.stats.reads_started += len(orders)
        self.stats.writes_started += len(orders)
        return ReadGo(orders=tuple(orders))

    def _arm(self, now: float, req: Request) -> ReadDeferred | ReadDeclined:
        """Ask every holder rank not yet armed to arm (again, once a third of ``ack_timeout``
        passed without its answer); decline once ``ack_timeout`` passed."""
        if req.defer_until == math.inf:
            req.defer_until = now + self.config.ack_timeout
        elif now >= req.defer_until:
            self._fail(now, req, FailReason.NOT_ARMED)
            return ReadDeclined(reason=FailReason.NOT_ARMED)
        resend = self.config.ack_timeout / 3
        for rank, part in req.parts.items():
            if part.state is _ARMED or now < part.arm_sent + resend:
                continue
            session = self._sessions[(req.ticket.holder_engine, rank)]
            part.state = read_next(part.state, _ON_ARM)
            part.arm_sent = now
            arm = wire.Arm(claim=wire.Claim(lease=req.ticket.lease, proof=req.proof))
            self._out.append(SendFrame(peer=session.peer, payload=wire.encode(arm, session.up)))
        return ReadDeferred(until=req.defer_until, heartbeats=0)

    def _on_arm_ack(self, now: float, session: Session, ack: wire.ArmAck) -> None:
        req, part = find_part(self._requests, session, ack.lease)
        if req is None or part is None or part.state is not _ARMING:
            self.stats.unexpected_frames += 1  # late, duplicated, or for no write
            return
        if not ack.armed:
            self._fail(now, req, FailReason.LEASE_LOST)
            return
        part.state = read_next(part.state, _ON_ARM_ACKED)
        part.lower_bound = max(
            part.lower_bound, bounds.acked_bound(part.arm_sent, ack.left, self._drift)
        )

    def write_completed(self, now: float, request_id: str, holder_rank: int) -> None:
        """The transport says the write to ``holder_rank`` landed (remote completion): its
        done went with it, so an abort held back for it is dropped; then as
        :meth:`read_completed` (the holder's verdict is awaited)."""
        self._write_ended(request_id, holder_rank)
        self.read_completed(now, request_id, holder_rank)

    def write_failed(self, now: float, request_id: str, holder_rank: int) -> None:
        """The transport says the write to ``holder_rank`` failed (none of its data lands
        any more): an abort held back for it leaves now; then as :meth:`read_failed`."""
        held = self._write_ended(request_id, holder_rank)
        if held is not None:
            engine, lease, proof = held
            session = self._sessions.get((engine, holder_rank))
            if session is not None and session.state is _OPEN:
                session.beats.pending_aborts[lease] = proof
                self._holders.beat(now, session)
        self.read_failed(now, request_id, holder_rank)

    def _write_ended(self, request_id: str, rank: int) -> tuple[str, int, bytes] | None:
        """The part's write is no longer in flight: the abort held back for it, if any."""
        self._wake = _UNKNOWN
        req = self._requests.get(request_id)
        part = None if req is None else req.parts.get(rank)
        if part is not None:
            part.writing = False
        return self._held_aborts.pop((request_id, rank), None)
