"""How a reader's request ends: finished, failed or declined, and what its lease then needs.

A request ends by :meth:`~kvproto.reader.Reader.finish` (it left the scheduler) or by
failing (a race, a lost or fenced lease, a declined read). Either way each holder
rank it read from is told what it needs to know: nothing while the request was
parked (never claimed), an abort when its blocks may still be held (at once on an
open session, with the first heartbeat after the Welcome otherwise, and only once a
write in flight ended), and no abort when the holder ended the lease itself. A lease
several requests read is let go only by its last reader
(:meth:`~kvproto.reader_fanout.Fanouts.let_go`). :class:`ReaderEnds` is a part of
:class:`~kvproto.reader.Reader` (its base class), as :mod:`kvproto.reader_writes`
is: apart because the ends are a concern of their own that every other part calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvproto.events import FailReason, ReadDeclined, RequestFailed
from kvproto.reader_requests import UNKNOWN_WAKE, Request, release
from kvproto.states import ReadInput, ReadState, SessionState, read_next

if TYPE_CHECKING:
    from kvproto.events import ReaderOutput
    from kvproto.reader_dones import AwaitedDones
    from kvproto.reader_fanout import Fanouts
    from kvproto.reader_peers import HolderSessions
    from kvproto.reader_requests import Deferrals, SessionKey
    from kvproto.reader_session import Session
    from kvproto.stats import ReaderStats

_UNKNOWN = UNKNOWN_WAKE  # module constants: see kvproto.reader
_CONNECTING = SessionState.CONNECTING
_HELLO_SENT = SessionState.HELLO_SENT
_OPEN = SessionState.OPEN
_FINISHED = ReadState.FINISHED
_STARTED = frozenset({ReadState.READING, ReadState.AWAITING_ACK})
_ON_FAIL = ReadInput.FAIL
_ON_FINISH = ReadInput.FINISH
_HOLDER_ALREADY_ENDED = frozenset(
    {FailReason.LEASE_LOST, FailReason.REVOKED, FailReason.HOLDER_RESTARTED}
)


class ReaderEnds:
    """The ends of :class:`~kvproto.reader.Reader`'s requests. See the module docstring."""

    if TYPE_CHECKING:
        stats: ReaderStats
        _wake: float
        _drift: float
        _requests: dict[str, Request]
        _sessions: dict[SessionKey, Session]
        _by_lease: dict[str, dict[int, str]]
        _holders: HolderSessions
        _fanouts: Fanouts
        _dones: AwaitedDones
        _deferrals: Deferrals
        _out: list[ReaderOutput]
        _held_aborts: dict[tuple[str, int], tuple[str, int, bytes]]

    def finish(self, now: float, request_id: str) -> None:
        """The request left the scheduler (finished, aborted, rejected): stop tracking it.

        If the blocks were not read (or not confirmed), the holder is told to
        free them now instead of waiting for the lease to lapse (vLLM #41269).
        An id not tracked (finished already, or never tracked) is counted in
        ``stats.untracked_finishes`` and ignored: finishing is idempotent.
        """
        self._wake = _UNKNOWN
        req = self._requests.get(request_id)
        if req is None:
            self.stats.untracked_finishes += 1
            return
        self._pop(req)
        self._deferrals.ids.discard(request_id)
        for part in req.parts.values():
            part.state = read_next(part.state, _ON_FINISH)
            if part.state is _FINISHED:  # not read, or not confirmed
                self._dones.forget(request_id, part.rank)
                self._abort_at(now, req, part.rank)
        if self._fanouts.count:
            self._fanouts.leave(req)

    def _pop(self, req: Request) -> None:
        del self._requests[req.request_id]
        index = self._by_lease.get(req.ticket.holder_engine)
        lease = req.ticket.lease
        # Lease ids repeat across holder incarnations: the entry may be a newer request's.
        if index is not None and index.get(lease) == req.request_id:
            group = self._fanouts.group_of(req) if self._fanouts.count else None
            if group is None or len(group.members) <= 1:
                del index[lease]  # else Fanouts.leave names a sibling in it

    def _fail(self, now: float, req: Request, reason: FailReason) -> None:
        if req.confirmed or req.failed:
            return
        self._deferrals.ids.discard(req.request_id)
        req.fail_reason = reason
        if reason in (FailReason.LEASE_LOST, FailReason.REVOKED):
            self.stats.lost += 1
        for rank, part in req.parts.items():
            was_started = part.state in _STARTED
            part.state = read_next(part.state, _ON_FAIL)
            self._dones.forget(req.request_id, rank)
            if was_started or reason not in _HOLDER_ALREADY_ENDED:
                self._abort_at(now, req, rank)
            else:  # the holder ended the lease itself: nothing to abort
                session = self._sessions[(req.ticket.holder_engine, rank)]
                if req.request_id in session.parked:
                    session.parked.remove(req.request_id)
                self._let_go(now, session, req, rank)
        self._out.append(RequestFailed(request_id=req.request_id, reason=reason))

    def _decline(self, now: float, req: Request) -> None:
        """The lease may end before the read would: the request recomputes."""
        self.stats.declined += 1
        self._fail(now, req, FailReason.DEADLINE_TOO_CLOSE)

    def _declined_after_failure(
        self, req: Request, reason: FailReason, event: ReadInput
    ) -> ReadDeclined:
        """A begin of a request that failed since the caller's checks (a race): declined."""
        for part in req.parts.values():
            part.state = read_next(part.state, event)  # the table: it stays failed
        self.stats.reads_after_failure += 1
        return ReadDeclined(reason=reason)

    def _abort_at(self, now: float, req: Request, rank: int) -> None:
        session = self._sessions[(req.ticket.holder_engine, rank)]
        lease = req.ticket.lease
        if req.request_id in session.parked:
            session.parked.remove(req.request_id)  # never claimed: nothing to abort
            return
        if not self._let_go(now, session, req, rank):
            return  # only the last reader of the lease aborts it
        if req.parts[rank].writing:
            # Its write is in flight: an abort now could overtake the data and let the
            # holder reuse the blocks under it (spec/push-mode.md, W3).
            self._held_aborts[(req.request_id, rank)] = (req.ticket.holder_engine, lease, req.proof)
            self.stats.aborts_held += 1
            return
        if session.state is _OPEN:
            session.beats.pending_aborts[lease] = req.proof
            self._holders.beat(now, session)  # free the holder's memory now, not at the next tick
        elif session.state in (_CONNECTING, _HELLO_SENT):
            # Not welcomed yet: the first heartbeat after Welcome carries the abort,
            # so a request given up before the handshake does not strand its blocks
            # for a whole lease (vLLM #41269).
            session.beats.pending_aborts[lease] = req.proof

    def _let_go(self, now: float, session: Session, req: Request, rank: int) -> bool:
        """``req`` no longer needs its lease from holder ``rank``: stop heartbeating it, unless
        a sibling still needs it (False: :meth:`~kvproto.reader_fanout.Fanouts.let_go`)."""
        fanouts = self._fanouts
        group = fanouts.group(session, req) if fanouts.count else None
        if group is not None:
            return fanouts.let_go(now, group, session, req, rank)
        release(
            self._requests, session, req.ticket.lease, req.request_id, now=now, drift=self._drift
        )
        return True
