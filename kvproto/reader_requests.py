"""A reader's tracked requests: what it can prove about their deadlines, and the one deferral.

:class:`Request` and its per-holder-rank :class:`Part` are the reader's data;
the functions here read them with the holder rank's
:class:`~kvproto.reader_session.Session` (the maths is :mod:`kvproto.bounds`).
:class:`Deferrals` keeps the reads put off for one early heartbeat (see
``Reader.begin_read`` and spec/timing.md). Nothing here sends or fails
anything itself: the reader passes its heartbeat in and acts on the answers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import msgspec

from kvproto import bounds
from kvproto.events import FailReason, ReadDeferred
from kvproto.reader_session import Session
from kvproto.states import ReadInput, ReadState, SessionState, read_next
from kvproto.ticket import LeaseTicket

SessionKey = tuple[str, int]
"""(holder engine, holder rank)."""

UNKNOWN_WAKE = -math.inf
"""``Reader._wake`` once an input came since ``get_timer`` last looked (any input may
set or clear a timer, so every input method sets it)."""

_CONFIRMED = ReadState.CONFIRMED
_ON_DEFER = ReadInput.DEFER
_OPEN = SessionState.OPEN


# Part and Request are msgspec Structs, not dataclasses, for one reason: every track
# makes one of each, and CPython 3.11 makes a Python class instance at ~3-4k
# instructions against msgspec's ~1k (mutable, attribute access as fast as slots).
# gc=False: neither can be part of a reference cycle (a Part holds only scalars and
# bytes, a Request its ticket, scalars and its own Parts), so the cyclic collector
# need not track them: ~0.2k instructions less to make each, and less for it to walk.


class Part(msgspec.Struct, gc=False):
    """A request's relation to one holder rank."""

    rank: int
    state: ReadState = ReadState.TRACKED
    lower_bound: float = -math.inf
    claimed_seq: float = math.inf
    early_held: bool = False
    done_frame: bytes = b""
    ack_deadline: float = math.inf
    next_resend: float = math.inf
    resends: int = 0
    defer_seq: int = -1
    """Deferred read: the heartbeat seq whose acknowledgement settles it (-1: none awaited)."""
    writing: bool = False
    """A write (push mode) of this part is in flight: no abort may leave until the
    transport reports it (spec/push-mode.md, W3)."""
    arm_sent: float = -math.inf
    """Push mode: when the part's last Arm left (ARMING); its ArmAck's ``left`` counts
    from then."""


class Request(msgspec.Struct, gc=False):
    """One tracked request: its ticket and one :class:`Part` per holder rank it reads from."""

    request_id: str
    ticket: LeaseTicket
    proof: bytes
    tracked_at: float
    parts: dict[int, Part]
    defer_until: float = math.inf
    """Deferred read, or a write waiting for its ArmAcks: without the holder's answer by
    then, the request is declined."""
    fail_reason: FailReason | None = None
    """Why the request failed (None: it has not)."""
    writes: bool = False
    """The request *writes* the holder's blocks (push mode): the reader writes only on an
    acknowledged claim and holds an abort back while a write is in flight."""

    @property
    def failed(self) -> bool:
        """The request failed: every part is FAILED, by the one path that fails parts
        (``Reader._fail``, which records the reason)."""
        return self.fail_reason is not None

    @property
    def confirmed(self) -> bool:
        """Every holder rank confirmed the read."""
        return bool(self.parts) and all(p.state is _CONFIRMED for p in self.parts.values())

    def claim_acked(self, rank: int) -> bool:
        """The holder rank ``rank`` acknowledged this request's claim."""
        part = self.parts.get(rank)
        return part is not None and part.claimed_seq < math.inf


def find_part(
    requests: Mapping[str, Request], session: Session, lease: int
) -> tuple[Request | None, Part | None]:
    """The request a holder's frame naming ``lease`` is about, and its part towards
    ``session``'s holder rank (None: no tracked request reads it)."""
    rid = session.by_lease.get(lease)
    req = None if rid is None else requests.get(rid)
    return req, None if req is None else req.parts.get(session.rank)


# ------------------------------------------------------------ bounds


def heartbeated(session: Session, req: Request) -> bool:
    """Whether ``session`` heartbeats ``req``'s lease for it (lease ids repeat across holder
    incarnations: the entry must be this request's, or its lease's group's)."""
    lease = req.ticket.lease
    rid = req.request_id
    if session.beats.leases.owner(lease) == rid:
        return True
    if not session.fanout:
        return False
    group = session.fanout.get(lease)
    return group is not None and rid in group.members and lease in session.beats.leases


def in_sync_bound(req: Request, part: Part, session: Session, now: float, drift: float) -> float:
    """What the session's in-sync heartbeats prove about ``part``'s deadline."""
    beats = session.beats
    return bounds.in_sync_bound(
        claimed_seq=part.claimed_seq,
        in_sync_seq=beats.in_sync_seq,
        in_sync_since=beats.in_sync_since,
        params=session.params,
        drift=drift,
        skew=session.skew,
        ticket=req.ticket,
        now=now,
    )


def release(
    requests: Mapping[str, Request],
    session: Session,
    lease: int,
    request_id: str,
    *,
    now: float,
    drift: float,
) -> bool:
    """Stop heartbeating ``lease`` on ``session`` for ``request_id``; False if the session's
    set does not name that request for it (not held, or another incarnation's request)."""
    beats = session.beats
    if beats.leases.owner(lease) != request_id:
        return False
    req = requests.get(request_id)
    part = None if req is None else req.parts.get(session.rank)
    if req is not None and part is not None:
        # Later in-sync heartbeats no longer cover this lease: keep what the
        # earlier ones proved, and stop deriving anything new from them.
        in_sync = in_sync_bound(req, part, session, now, drift)
        part.lower_bound = max(part.lower_bound, in_sync)
    beats.release(lease)
    return True


def deadline_bound(req: Request, part: Part, session: Session, now: float, drift: float) -> float:
    """A lower bound on the local time the holder rank may free ``part``'s blocks."""
    if session.incarnation is not None and req.ticket.holder_incarnation != session.incarnation:
        return -math.inf  # a ticket of another holder process: nothing is known
    bound = max(part.lower_bound, bounds.ticket_bound(session.skew, req.ticket, now))
    if heartbeated(session, req):
        bound = max(bound, in_sync_bound(req, part, session, now, drift))
    return bound


def renewable(req: Request, session: Session, now: float, margin: float, drift: float) -> bool:
    """Whether one heartbeat could move this part's bound past the margin.

    True unless the lease is known to be ending whatever the reader sends: a
    ticket of another holder incarnation, a lease this session does not
    heartbeat, the holder's max_hold cap within the margin, or a lease that
    already lapsed by the session's own record (:func:`kvproto.bounds.lapsed`).
    (LATE, REFUSED, lost or revoked leases have failed the request already.)
    """
    params = session.params
    return (
        session.state is _OPEN
        and params is not None
        and session.incarnation == req.ticket.holder_incarnation
        and heartbeated(session, req)
        and margin < params.extension * (1 - drift)
        and now + margin < bounds.hard_bound(session.skew, req.ticket, params, now)
        and not bounds.lapsed(
            tracked_at=req.tracked_at,
            ticket=req.ticket,
            extension=params.extension,
            beats=session.beats.inflight.values(),
            drift=drift,
            now=now,
        )
    )


# ------------------------------------------------------------ deferral

Beat = Callable[[float, Session], int]
"""The reader's heartbeat of a session now; returns the frames sent."""


class Deferrals:
    """The reads put off for one early heartbeat, until the holder answers it."""

    def __init__(
        self,
        requests: Mapping[str, Request],
        sessions: Mapping[SessionKey, Session],
        ack_timeout: float,
    ) -> None:
        self.ids: set[str] = set()
        """Ids of the deferred requests not yet decided."""
        self._requests = requests
        self._sessions = sessions
        self._ack_timeout = ack_timeout

    def defer(self, now: float, req: Request, close: Iterable[int], beat: Beat) -> ReadDeferred:
        """Heartbeat the sessions of the ``close`` parts now; decide when they answer."""
        sent = 0
        for rank in close:
            session = self._sessions[(req.ticket.holder_engine, rank)]
            beats = session.beats
            if beats.last_beat < now or beats.acked_seq >= beats.seq:
                sent += beat(now, session)  # the session's normal heartbeat, early
            # The last frame of the beat states the whole set: its ack settles the part.
            req.parts[rank].defer_seq = beats.seq
        for part in req.parts.values():
            part.state = read_next(part.state, _ON_DEFER)
        req.defer_until = now + self._ack_timeout
        self.ids.add(req.request_id)
        return ReadDeferred(until=req.defer_until, heartbeats=sent)

    def resync(self, now: float, session: Session, seq: int, beat: Beat) -> None:
        """A deferral's heartbeat was answered "resync": send the full list now, not at
        the next tick (a lease the holder detached from a lapsed session but still
        holds on its own deadline is re-attached by it), and wait for that answer."""
        waiting = [
            part
            for rid in self.ids
            if (req := self._requests[rid]).ticket.holder_engine == session.engine
            and (part := req.parts.get(session.rank)) is not None
            and part.defer_seq == seq
        ]
        if not waiting:
            return
        beat(now, session)
        for part in waiting:
            part.defer_seq = session.beats.seq

    def settled(self, req: Request) -> bool:
        """Every heartbeat a deferred read waits for has been acknowledged."""
        engine = req.ticket.holder_engine
        return all(
            part.defer_seq <= self._sessions[(engine, rank)].beats.acked_seq
            for rank, part in req.parts.items()
        )

    def next_due(self) -> float:
        """The earliest time an unanswered deferral runs out (inf: none)."""
        best = math.inf
        for rid in self.ids:
            req = self._requests[rid]
            if not self.settled(req):
                best = min(best, req.defer_until)
        return best

    def expire(self, now: float, decline: Callable[[Request], None]) -> None:
        """Forget the answered deferrals (the caller's next begin_read decides); ``decline``
        those whose heartbeat the holder did not answer in time, as begin_read would
        have without the deferral."""
        for rid in list(self.ids):
            req = self._requests[rid]
            if self.settled(req):
                self.ids.discard(rid)
            elif req.defer_until <= now:
                decline(req)
