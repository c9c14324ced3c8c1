"""The reader: heartbeats leases from scheduler entry, reads, and trusts data only when fenced.

Sans-I/O like :mod:`kvproto.holder`. One :class:`Reader` serves one reader
rank; it keeps the requests and ties the parts together: the sessions with the
holder ranks, their table, life cycle, timers and heartbeats
(:mod:`kvproto.reader_peers`; one session's own state is
:mod:`kvproto.reader_session`, its timer bookkeeping :mod:`kvproto.reader_timers`),
what a heartbeat carries (:mod:`kvproto.beats`), the holder's acknowledgements and
verdicts (:mod:`kvproto.reader_answers`), the leases several requests read
(:mod:`kvproto.reader_fanout`), deadline maths (:mod:`kvproto.bounds`), the
per-request bounds and read deferral (:mod:`kvproto.reader_requests`), the dones
awaiting their verdict (:mod:`kvproto.reader_dones`), which holder frames are
heard at all (:mod:`kvproto.reader_frames`) and push mode's writes
(:mod:`kvproto.reader_writes`). Reads
are fenced before (:meth:`Reader.begin_read` declines, or defers once for an
early heartbeat, when the lease may end within ``read_margin``) and after
(the data counts only once the holder answers HELD to the done that rode the
read): spec/timing.md and spec/state-tables.md say why and how.

Races are inputs, not errors: a read result or a ``finish`` for a request no
longer tracked, a ``begin_read`` for one that failed meanwhile, or
``connected`` for a session that broke meanwhile, is counted in
:class:`~kvproto.stats.ReaderStats`. :class:`~kvproto.errors.LocalProtocolError`
means API misuse only (each method's docstring says which).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable

from kvproto import auth, bounds, wire
from kvproto.clock import SkewEstimator
from kvproto.config import LeaseConfig
from kvproto.errors import LocalProtocolError
from kvproto.events import (
    FailReason,
    ReadDeclined,
    ReadDeferred,
    ReaderOutput,
    ReadGo,
    ReadOrder,
)
from kvproto.reader_answers import Answers
from kvproto.reader_dones import AwaitedDones, done_frame
from kvproto.reader_ends import ReaderEnds
from kvproto.reader_fanout import Fanouts
from kvproto.reader_frames import Unheard, heard
from kvproto.reader_peers import HolderSessions
from kvproto.reader_requests import (
    UNKNOWN_WAKE,
    Deferrals,
    Part,
    Request,
    SessionKey,
    deadline_bound,
    release,
    renewable,
)
from kvproto.reader_session import NEED_KEEPS_STATE, ReaderSide, Session
from kvproto.reader_writes import ReaderWrites
from kvproto.states import ReadInput, ReadState, SessionState, read_next
from kvproto.stats import ReaderStats, counts_of
from kvproto.ticket import LeaseTicket, claim_prover, ticket_problem
from kvproto.tpmath import BlockSlice, part_slices, write_slices
from kvproto.transport import PeerId

# Enum members as module constants: CPython 3.11 resolves ``State.MEMBER`` through
# a descriptor, ~10x a global's cost, and these are read on every track, tick and ack.
_AWAITING_ACK = ReadState.AWAITING_ACK
_IDLE = SessionState.IDLE
_ON_BEGIN_READ = ReadInput.BEGIN_READ
_ON_READ_DONE = ReadInput.READ_DONE
_OPEN = SessionState.OPEN
_WHOLE = (BlockSlice.FULL, BlockSlice.FULL)  # a done-only order's (unused) slices
_UNKNOWN = UNKNOWN_WAKE
_NEVER = math.inf  # Reader._wake: no timer is set


class Reader(ReaderEnds, ReaderWrites):
    """Reader-side lease state for one reader rank. See the module docstring.

    How its requests end is :class:`ReaderEnds`; push mode's writer side
    (``track(..., writes=True)``) is :class:`ReaderWrites`."""

    def __init__(
        self,
        config: LeaseConfig,
        *,
        engine: str,
        incarnation: int,
        rank: int = 0,
        tp_size: int = 1,
        replicated_kv: bool = False,
        entropy: Callable[[int], bytes] = secrets.token_bytes,
    ) -> None:
        """``replicated_kv``: every holder rank keeps the whole KV (MLA), so a request
        reads from one of its holder ranks and sends the others only its done
        (:func:`kvproto.tpmath.part_slices`); a ``writes=True`` request writes all of
        it into every holder rank (:func:`kvproto.tpmath.write_slices`)."""
        if not 0 <= rank < tp_size:
            raise LocalProtocolError(f"rank {rank} outside TP size {tp_size}")
        self.config = config
        self.engine = engine
        self.incarnation = incarnation
        self.rank = rank
        self.tp_size = tp_size
        self.replicated_kv = replicated_kv
        self.stats = ReaderStats()
        self._drift = config.drift
        self._requests: dict[str, Request] = {}
        self._sessions: dict[SessionKey, Session] = {}
        """The sessions by holder rank; :class:`HolderSessions` alone makes them."""
        self._dones = AwaitedDones(self._requests, self._sessions, config)
        self._holders = holders = HolderSessions(
            ReaderSide(
                engine=engine, rank=rank, tp_size=tp_size, incarnation=incarnation, config=config
            ),
            self._requests,
            self._sessions,
            stats=self.stats,
            entropy=entropy,
            fail=self._fail,
            attach=self._attach,
            awaiting=self._dones.of_session,
        )
        self._timers = holders.timers  # track schedules the claim's heartbeat itself
        self._routes = holders.routes  # and reads the route cache before asking for a route
        self._by_lease = holders.by_lease
        """Holder engine → lease id → request id (each engine's sessions share its dict)."""
        self._prove = claim_prover(engine)
        """The claim proof of a ticket, with this reader's engine in it prepared once."""
        self._deferrals = Deferrals(self._requests, self._sessions, config.ack_timeout)
        self._fanouts = Fanouts(
            self._requests,
            self._sessions,
            holders,
            stats=self.stats,
            dones=self._dones,
            drift=self._drift,
            fail=self._fail,
        )
        """The leases several requests read (:mod:`kvproto.reader_fanout`)."""
        self._answers = Answers(
            self._requests,
            holders,
            self._fanouts,
            stats=self.stats,
            drift=self._drift,
            deferrals=self._deferrals,
            dones=self._dones,
            prove_verdict=auth.verdict_prover(engine, rank),
            fail=self._fail,
        )
        """The holder's acknowledgements and verdicts (:mod:`kvproto.reader_answers`)."""
        self._wake = _UNKNOWN
        """The next time timer work is due (inf: none), as :meth:`get_timer` last found it;
        ``_UNKNOWN`` once an input has come since, as any input may set or clear a timer:
        every input method forgets it first. An idle step (the binding's ``handle_timer``
        then ``get_timer`` with no input between) then costs two comparisons."""
        self._out = holders.out
        """What the binding must do, in order; one list with ``holders.out`` (:meth:`drain`)."""
        self._held_aborts: dict[tuple[str, int], tuple[str, int, bytes]] = {}
        """(request id, holder rank) → (holder engine, lease, proof) of an abort held back
        while that part's write is in flight (push mode, W3); sent if the write fails."""

    # ------------------------------------------------------------------ API

    def track(
        self,
        now: float,
        *,
        request_id: str,
        ticket: LeaseTicket,
        readers: int = 1,
        writes: bool = False,
    ) -> None:
        """Start keeping ``ticket``'s lease alive: call when the request enters the scheduler.

        ``readers``: how many requests of this reader rank will read ``ticket`` (vLLM's
        parallel-sampling children, which reach the scheduler one message each); the
        lease's done waits for that many (at most ``ack_timeout`` past a landed read),
        so a first child scheduled before its siblings arrive does not free the blocks
        they are to read. ``writes``: this reader writes the holder's blocks (push
        mode, spec/push-mode.md): :meth:`begin_write` arms the holder's write fence
        right before the write. A bad ticket fails the request (``RequestFailed``).
        Tracking an id that is tracked already is misuse: :class:`LocalProtocolError`.
        """
        self._wake = _UNKNOWN
        if request_id in self._requests:
            raise LocalProtocolError(f"request {request_id!r} is already tracked")
        self.stats.tracked += 1
        # First: the ticket bounds holder_tp_size before it picks the sessions.
        if ticket_problem(ticket) is not None:
            sessions: tuple[Session, ...] = ()
        else:
            route = self._routes.get((ticket.holder_engine, ticket.holder_tp_size))
            sessions = self._holders.route(ticket) if route is None else route
        if not sessions:
            req = self._requests[request_id] = Request(
                request_id, ticket, b"", now, {}, writes=writes
            )
            self._fail(now, req, FailReason.BAD_TICKET)
            return
        lease = ticket.lease
        proof = self._prove(ticket.token, lease)
        # One pass makes the parts and checks the ticket against every session; the
        # checks only read, so the first problem found is the one the request fails with.
        # Inline, not a function of reader_requests: track is the per-request hot path.
        parts = {}
        problem: FailReason | None = None
        restarted: list[Session] | None = None  # None, not []: a track rarely meets one
        for session in sessions:
            parts[session.rank] = Part(session.rank)
            incarnation = session.incarnation
            if incarnation is None or problem is not None:
                continue  # not welcomed yet: nothing to check against (no clock sample either)
            if incarnation != ticket.holder_incarnation:
                if ticket.holder_incarnation in session.stale_incarnations:
                    problem = FailReason.HOLDER_RESTARTED
                # A ticket from an incarnation this session has not met: the holder
                # probably restarted (then every later ticket is of the new one). Say
                # Hello again; the Welcome tells which requests hold dead tickets.
                elif restarted is None:
                    restarted = [session]
                else:
                    restarted.append(session)
            elif session.skew.known and bounds.ticket_bound(session.skew, ticket, now) <= now:
                problem = FailReason.BAD_TICKET
        req = self._requests[request_id] = Request(
            request_id, ticket, proof, now, parts, writes=writes
        )
        if problem is not None:
            self._fail(now, req, problem)
            return
        if restarted is not None:
            self._park(now, request_id, restarted)
        elif self._fanouts.shared(now, req, sessions, readers):
            return  # another request reads this ticket: one claim and heartbeat serve both
        # The route's sessions are all of the ticket's engine and share its lease index:
        # one entry serves them.
        if restarted is None or len(restarted) < len(sessions):
            sessions[0].by_lease[lease] = request_id
        for session in sessions:
            state = session.state
            if state not in NEED_KEEPS_STATE:
                self._holders.need(session)
                state = session.state
            if restarted is not None and session in restarted:
                continue
            session.beats.hold(lease, request_id, proof)
            if state is _OPEN:
                # The claim leaves at the binding's next pump, not at the next tick:
                # until the holder has it the lease is not tied to this reader, so the
                # reader's death would free it only by expiry. Tracks of one engine
                # step still share one heartbeat; the tick is counted from it.
                self._timers.schedule(session, now)

    def _park(self, now: float, request_id: str, restarted: list[Session]) -> None:
        """Hold the request back on sessions whose holder it may have outlived (see track)."""
        for session in restarted:
            session.parked.append(request_id)
            if session.state is _OPEN:
                self._holders.rehello(now, session)

    def is_tracked(self, request_id: str) -> bool:
        """Whether ``request_id`` is tracked (tracked and not finished yet)."""
        return request_id in self._requests

    def ready_to_read(self, request_id: str) -> bool:
        """Every holder rank this request reads from has an open session.

        An id not tracked is misuse (:class:`LocalProtocolError`; ask :meth:`is_tracked`).
        """
        req = self._get(request_id)
        engine = req.ticket.holder_engine
        return all(self._sessions[(engine, r)].state is _OPEN for r in req.parts)

    def begin_read(self, now: float, request_id: str) -> ReadGo | ReadDeferred | ReadDeclined:
        """Decide whether to read now. ``ReadGo`` lists one transfer per holder rank.

        ``ReadDeferred``: the bound was too close only for lack of a recent
        acknowledgement; a heartbeat left early. Call again on a later step.
        A request that already failed (it can fail between the caller's checks
        and this call: a race) is declined with its failure's reason and counted
        in ``stats.reads_after_failure``. Misuse (:class:`LocalProtocolError`):
        an id not tracked, or one without open sessions (:meth:`ready_to_read`).
        """
        self._wake = _UNKNOWN
        req = self._get(request_id)
        if req.fail_reason is not None:
            return self._declined_after_failure(req, req.fail_reason, _ON_BEGIN_READ)
        if not self.ready_to_read(request_id):
            raise LocalProtocolError(f"request {request_id!r} has no open session yet")
        margin = bounds.read_margin(self.config.read_margin, req.ticket)
        close = [r for r in req.parts if now + margin >= self._deadline_bound(req, r, now)]
        if close:
            deferred = req.defer_until < math.inf  # once deferred, never again
            if deferred and now < req.defer_until and not self._deferrals.settled(req):
                return ReadDeferred(until=req.defer_until, heartbeats=0)
            engine, drift = req.ticket.holder_engine, self._drift
            if not deferred and all(
                renewable(req, self._sessions[(engine, r)], now, margin, drift) for r in close
            ):
                self.stats.deferred += 1
                return self._deferrals.defer(now, req, close, self._holders.beat)
            self._decline(now, req)
            return ReadDeclined(reason=FailReason.DEADLINE_TOO_CLOSE)
        group = self._fanouts.group_of(req) if self._fanouts.count else None
        if group is not None and group.done_sent:
            # A sibling's done went without this request (it had not begun in time): that
            # done's verdict does not cover this read, and the holder may have freed.
            self.stats.fanout_late_reads += 1
            self._fail(now, req, FailReason.LEASE_LOST)
            return ReadDeclined(reason=FailReason.LEASE_LOST)
        self._deferrals.ids.discard(request_id)
        orders = []
        for rank, part in req.parts.items():
            session = self._sessions[(req.ticket.holder_engine, rank)]
            part.state = read_next(part.state, _ON_BEGIN_READ)
            part.done_frame = (
                done_frame(req, session.up)
                if group is None
                else self._fanouts.done_of(now, group, req, rank, session.up)
            )
            orders.append(self._order(req, session, rank, part.done_frame))
        self.stats.reads_started += len(orders)
        return ReadGo(orders=tuple(orders))

    def _order(self, req: Request, session: Session, rank: int, notify: bytes) -> ReadOrder:
        """The transfer this reader rank makes with holder ``rank``, ``notify`` attached."""
        slices = (write_slices if req.writes else part_slices)(
            self.rank,
            self.tp_size,
            req.ticket.holder_tp_size,
            rank,
            replicated=self.replicated_kv,
        )
        local_slice, remote_slice = slices or _WHOLE
        return ReadOrder(
            holder_rank=rank,
            peer=session.peer,
            notify=notify,
            local_slice=local_slice,
            remote_slice=remote_slice,
            carries_data=slices is not None,
        )

    def read_completed(self, now: float, request_id: str, holder_rank: int) -> None:
        """The transport says the read from ``holder_rank`` landed; await the verdict.

        A request no longer tracked (finished while its read was in flight) is
        counted in ``stats.late_read_results`` and ignored; a holder rank the
        request does not read from is misuse (:class:`LocalProtocolError`).
        """
        self._wake = _UNKNOWN
        req = self._result_of(request_id, holder_rank)
        if req is None:
            return
        part = req.parts[holder_rank]
        part.state = read_next(part.state, _ON_READ_DONE)
        if part.state is not _AWAITING_ACK:  # failed meanwhile: nothing to await
            return
        session = self._sessions[(req.ticket.holder_engine, holder_rank)]
        fanouts = self._fanouts
        group = fanouts.group(session, req) if fanouts.count else None
        if group is None:
            release(
                self._requests, session, req.ticket.lease, request_id, now=now, drift=self._drift
            )
        elif not part.done_frame:
            fanouts.settle(now, group, session, holder_rank)  # the done goes once all landed
            return
        else:
            fanouts.release_lease(now, session, req.ticket.lease)
        if part.early_held:
            self._answers.held(req, part)
            return
        self._dones.expect(now, req, part)

    def read_failed(self, now: float, request_id: str, holder_rank: int) -> None:
        """The transport says the read from ``holder_rank`` failed: recompute.

        Untracked ids and wrong ranks as in :meth:`read_completed`.
        """
        self._wake = _UNKNOWN
        req = self._result_of(request_id, holder_rank)
        if req is not None:
            self._fail(now, req, FailReason.READ_FAILED)

    def connected(self, now: float, *, engine: str, rank: int, peer: PeerId) -> None:
        """The binding made holder ``(engine, rank)`` reachable as ``peer``: say Hello.

        A session that broke meanwhile stays broken (``stats.stale_connects``);
        a session never asked for (no ``Connect`` output) is misuse.
        """
        self._wake = _UNKNOWN
        self._holders.connected(now, self._known_session(engine, rank), peer)

    def connect_failed(self, now: float, *, engine: str, rank: int) -> None:
        """The binding could not reach holder ``(engine, rank)``: its requests recompute.

        A session never asked for is misuse (:class:`LocalProtocolError`).
        """
        self._wake = _UNKNOWN
        self._holders.break_(now, self._known_session(engine, rank), FailReason.CONNECT_FAILED)

    def peer_lost(self, now: float, peer: PeerId) -> None:
        """The transport says ``peer`` is gone: the blocks it held are gone too."""
        self._wake = _UNKNOWN
        self._holders.peer_lost(now, peer)

    def handle_frame(self, now: float, peer: PeerId, data: bytes) -> None:
        """Apply one notification from a holder. Bad input is dropped and counted."""
        self._wake = _UNKNOWN
        sessions = self._holders.by_peer.get(peer)
        if not sessions or len(data) > self.config.max_frame_bytes:
            self.stats.unexpected_frames += 1
            return
        session = sessions[-1]
        msg = heard(now, session, data, self._requests)
        if msg is Unheard.MALFORMED:
            self.stats.malformed += 1
        elif msg is Unheard.BAD_MAC:
            self.stats.bad_mac += 1
        elif isinstance(msg, wire.Welcome):
            self._holders.on_welcome(now, session, msg, data)
        elif isinstance(msg, wire.HeartbeatAck):
            self._answers.on_ack(now, session, msg)
        elif isinstance(msg, wire.DoneAck):
            self._answers.on_done_ack(now, session, msg)
        elif isinstance(msg, wire.Revoke):
            for lease in msg.leases:
                self._answers.lease_failed(now, session, lease, FailReason.REVOKED)
        elif isinstance(msg, wire.Reject):
            self._holders.on_reject(now, session, msg)
        elif isinstance(msg, wire.ArmAck):
            self._on_arm_ack(now, session, msg)
        else:
            self.stats.unexpected_frames += 1

    def get_timer(self) -> float | None:
        """The next time :meth:`handle_timer` has work, or None."""
        wake = self._wake
        if wake == _UNKNOWN:
            wake = self._wake = self._next_due()
        return None if wake == _NEVER else wake

    def _next_due(self) -> float:
        """The next time :meth:`handle_timer` has work (inf: none), found afresh."""
        return min(self._timers.next_due(), self._deferrals.next_due(), self._dones.next_due())

    def handle_timer(self, now: float) -> None:
        """Send due heartbeats, re-send unacknowledged dones, fence reads whose ack is late.

        Before the time :meth:`get_timer` said, with no input since, this is one comparison.
        """
        if now < self._wake:
            return  # nothing is due: the idle step (benchmarked)
        self._wake = _UNKNOWN
        self._holders.serve(now)
        dones = self._dones
        if dones.keys:
            self.stats.done_resent += dones.serve(
                now,
                lambda req: self._fail(now, req, FailReason.FENCED_NO_ACK),
                self._out.append,
                lambda req, rank: self._fanouts.held_back_ran_out(now, req, rank),
            )
        if self._deferrals.ids:
            self._deferrals.expire(now, lambda req: self._decline(now, req))

    def drain(self) -> list[ReaderOutput]:
        """Everything the binding must do now, in order."""
        out = self._out
        self._out = self._holders.out = []
        return out

    # ------------------------------------------------------------ queries

    def state(self, request_id: str) -> dict[int, ReadState]:
        """Holder rank → state of this request (an untracked id is misuse)."""
        return {r: p.state for r, p in self._get(request_id).parts.items()}

    def session_state(self, engine: str, rank: int) -> SessionState:
        """State of the session with holder ``(engine, rank)``."""
        session = self._sessions.get((engine, rank))
        return _IDLE if session is None else session.state

    def skew(self, engine: str, rank: int) -> SkewEstimator | None:
        """The clock-offset estimate towards a holder rank, if a session exists."""
        session = self._sessions.get((engine, rank))
        return None if session is None else session.skew

    def deadline_bound(self, now: float, request_id: str) -> float:
        """Earliest local time any holder rank of this request may free its blocks.

        An untracked id is misuse (ask :meth:`is_tracked`).
        """
        req = self._get(request_id)
        return min((self._deadline_bound(req, r, now) for r in req.parts), default=-math.inf)

    def tracked(self) -> int:
        """Requests currently tracked."""
        return len(self._requests)

    def stats_snapshot(self, prefix: str = "") -> dict[str, int]:
        """Counters plus the sizes of its tables (tracked requests, holder sessions),
        each key ``prefix + name``: what a long run watches for growth."""
        snap = counts_of(self.stats, prefix)
        snap[prefix + "requests"] = len(self._requests)
        snap[prefix + "sessions"] = len(self._sessions)
        return snap

    # ------------------------------------------------------------ helpers

    def _known_session(self, engine: str, rank: int) -> Session:
        session = self._sessions.get((engine, rank))
        if session is None:
            raise LocalProtocolError(f"no session was asked for {(engine, rank)}")
        return session

    def _attach(self, session: Session, req: Request) -> None:
        """The session heartbeats ``req``'s lease from now on (claim in the next beat)."""
        lease = req.ticket.lease
        first = session.by_lease.get(lease)
        if (
            first is not None
            and first != req.request_id
            and lease in session.beats.leases
            and self._fanouts.attach(session, req, first)
        ):
            return  # it reads the lease with ``first``: one claim serves both
        session.by_lease[lease] = req.request_id
        session.beats.hold(lease, req.request_id, req.proof)

    def _deadline_bound(self, req: Request, rank: int, now: float) -> float:
        session = self._sessions[(req.ticket.holder_engine, rank)]
        return deadline_bound(req, req.parts[rank], session, now, self._drift)

    def _get(self, request_id: str) -> Request:
        req = self._requests.get(request_id)
        if req is None:
            raise LocalProtocolError(f"request {request_id!r} is not tracked")
        return req

    def _result_of(self, request_id: str, rank: int) -> Request | None:
        """The request a transfer result is for; None (counted) if it is no longer tracked."""
        req = self._requests.get(request_id)
        if req is None:
            self.stats.late_read_results += 1
            return None
        if rank not in req.parts:
            raise LocalProtocolError(f"request {request_id!r} does not read from rank {rank}")
        return req
