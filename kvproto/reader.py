"""The reader: heartbeats leases from scheduler entry, reads, and trusts data only when fenced.

Sans-I/O like :mod:`kvproto.holder`. One :class:`Reader` serves one reader
rank; it keeps the requests and ties the parts together: the sessions with the
holder ranks, their table, life cycle, timers and heartbeats
(:mod:`kvproto.reader_sessions`; one session's own state is
:mod:`kvproto.reader_session`, its timer bookkeeping :mod:`kvproto.reader_timers`),
what a heartbeat carries (:mod:`kvproto.beats`),
deadline maths (:mod:`kvproto.bounds`), the per-request bounds and read
deferral (:mod:`kvproto.reader_requests`), the dones awaiting their verdict
(:mod:`kvproto.reader_dones`) and which holder frames are heard at all
(:mod:`kvproto.reader_frames`). Reads
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
from kvproto.clock import SkewEstimator, SkewSample
from kvproto.config import LeaseConfig
from kvproto.errors import LocalProtocolError
from kvproto.events import (
    FailReason,
    ReadConfirmed,
    ReadDeclined,
    ReadDeferred,
    ReaderOutput,
    ReadGo,
    ReadOrder,
    RequestFailed,
    SendFrame,
)
from kvproto.reader_dones import AwaitedDones, done_frame, verdict_of
from kvproto.reader_frames import Unheard, heard
from kvproto.reader_requests import (
    UNKNOWN_WAKE,
    Deferrals,
    Part,
    Request,
    SessionKey,
    deadline_bound,
    in_sync_bound,
    renewable,
)
from kvproto.reader_session import NEED_KEEPS_STATE, Fanout, ReaderSide, Session
from kvproto.reader_sessions import HolderSessions
from kvproto.reader_writes import ReaderWrites
from kvproto.states import (
    DoneAckAction,
    ReadInput,
    ReadState,
    SessionState,
    done_ack_action,
    read_next,
)
from kvproto.stats import ReaderStats, counts_of
from kvproto.ticket import LeaseTicket, claim_prover, ticket_problem
from kvproto.tpmath import BlockSlice, part_slices
from kvproto.transport import PeerId

_HOLDER_ALREADY_ENDED = frozenset(
    {FailReason.LEASE_LOST, FailReason.REVOKED, FailReason.HOLDER_RESTARTED}
)
# Enum members as module constants: CPython 3.11 resolves ``State.MEMBER`` through
# a descriptor, ~10x a global's cost, and these are read on every track, tick and ack.
_AWAITING_ACK = ReadState.AWAITING_ACK
_CLAIMED = ReadState.CLAIMED
_DEFERRED = ReadState.DEFERRED
_TRACKED = ReadState.TRACKED
_CONNECTING = SessionState.CONNECTING
_FINISHED = ReadState.FINISHED
_HELLO_SENT = SessionState.HELLO_SENT
_IDLE = SessionState.IDLE
_ON_ACK_HELD = ReadInput.ACK_HELD
_ON_BEGIN_READ = ReadInput.BEGIN_READ
_ON_CLAIM_ACKED = ReadInput.CLAIM_ACKED
_ON_FAIL = ReadInput.FAIL
_ON_FINISH = ReadInput.FINISH
_ON_READ_DONE = ReadInput.READ_DONE
_OPEN = SessionState.OPEN
_READING = ReadState.READING
_STARTED = frozenset({_READING, _AWAITING_ACK})
_UNSTARTED = frozenset({_TRACKED, _CLAIMED, _DEFERRED})
_STILL_READS = _UNSTARTED | {_READING}
"""A lease's reader in these states has still to read it (its lease must stay held)."""
_NEEDS_LEASE = _STILL_READS | {_AWAITING_ACK}
"""... and in these it still needs the lease not aborted (a verdict may be on its way)."""
_WHOLE = (BlockSlice.FULL, BlockSlice.FULL)  # a done-only order's (unused) slices
_UNKNOWN = UNKNOWN_WAKE
_NEVER = math.inf  # Reader._wake: no timer is set


class Reader(ReaderWrites):
    """Reader-side lease state for one reader rank. See the module docstring.

    Push mode's writer side (``track(..., writes=True)``) is :class:`ReaderWrites`."""

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
        (:func:`kvproto.tpmath.part_slices`)."""
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
        self._fanout = holders.fanout
        """Holder engine → lease id → its readers, for leases several requests read."""
        self._groups = 0
        """How many such leases there are: while none, no path looks for one."""
        """Holder engine → lease id → request id (each engine's sessions share its dict)."""
        self._prove = claim_prover(engine)
        self._prove_verdict = auth.verdict_prover(engine, rank)
        """The claim proof of a ticket, with this reader's engine in it prepared once."""
        self._deferrals = Deferrals(self._requests, self._sessions, config.ack_timeout)
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
        elif self._shared(now, req, sessions, readers):
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
        if self._groups:
            self._leave(req)

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
        group = self._group_of(req) if self._groups else None
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
            if group is None:
                part.done_frame = done_frame(req, session.up)
            elif self._last_reader(group, req, rank):
                # Every sibling's read has landed (or it left): the lease's one done for
                # this holder rank rides this read, after the data as for a lone reader.
                part.done_frame = done_frame(req, session.up)
                self._done_goes(now, group, rank, part.done_frame)
            else:
                part.done_frame = b""  # a sibling still reads: the done waits for it
            orders.append(self._order(req, session, rank, part.done_frame))
        self.stats.reads_started += len(orders)
        return ReadGo(orders=tuple(orders))

    def _declined_after_failure(
        self, req: Request, reason: FailReason, event: ReadInput
    ) -> ReadDeclined:
        """A begin of a request that failed since the caller's checks (a race): declined."""
        for part in req.parts.values():
            part.state = read_next(part.state, event)  # the table: it stays failed
        self.stats.reads_after_failure += 1
        return ReadDeclined(reason=reason)

    def _order(self, req: Request, session: Session, rank: int, notify: bytes) -> ReadOrder:
        """The transfer this reader rank makes with holder ``rank``, ``notify`` attached."""
        slices = part_slices(
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
        group = self._group(session, req) if self._groups else None
        if group is None:
            self._release(now, session, req.ticket.lease, request_id)
        elif not part.done_frame:
            self._settle(now, group, session, holder_rank)  # the done goes once all landed
            return
        else:
            self._release_lease(now, session, req.ticket.lease)
        if part.early_held:
            self._held(req, part)
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
            self._on_ack(now, session, msg)
        elif isinstance(msg, wire.DoneAck):
            self._on_done_ack(now, session, msg)
        elif isinstance(msg, wire.Revoke):
            for lease in msg.leases:
                self._lease_failed(now, session, lease, FailReason.REVOKED)
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
                lambda req, rank: self._held_back_ran_out(now, req, rank),
            )
        if self._deferrals.ids:
            self._deferrals.expire(now, lambda req: self._decline(now, req))

    def _decline(self, now: float, req: Request) -> None:
        """The lease may end before the read would: the request recomputes."""
        self.stats.declined += 1
        self._fail(now, req, FailReason.DEADLINE_TOO_CLOSE)

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

    # ------------------------------------------------------------ frames

    def _on_ack(self, now: float, session: Session, ack: wire.HeartbeatAck) -> None:
        beats = session.beats
        sent = beats.answered(now, ack.seq)
        if sent is None:
            self.stats.unexpected_frames += 1
            return
        self.stats.acks += 1
        session.skew.add(SkewSample(sent=sent.sent, peer=ack.clock, received=now))
        for lease, left in ack.held:
            if not beats.claim_answered(lease, sent):
                continue
            rid = beats.leases.owner(lease)
            req = None if rid is None else self._requests.get(rid)
            if req is None:
                continue
            part = req.parts[session.rank]
            acked = bounds.acked_bound(sent.sent, left, self._drift)
            part.lower_bound = max(part.lower_bound, acked)
            part.claimed_seq = min(part.claimed_seq, ack.seq)
            part.state = read_next(part.state, _ON_CLAIM_ACKED)
            group = session.fanout.get(lease) if self._groups else None
            if group is not None:
                for sibling in self._siblings(group, req.request_id):
                    self._copy_claim(part, sibling.parts[session.rank])
        for lease in ack.lost:
            beats.pending_claims.pop(lease, None)
            self._lease_failed(now, session, lease, FailReason.LEASE_LOST)
        if beats.compared(ack.seq, sent, resync=ack.resync):
            self._deferrals.resync(now, session, ack.seq, self._holders.beat)

    def _on_done_ack(self, now: float, session: Session, msg: wire.DoneAck) -> None:
        req, part = self._find(session, msg.lease)
        if req is None or part is None:
            self.stats.unexpected_frames += 1
            return
        verdict = verdict_of(msg, req, self._prove_verdict)
        if verdict is None:
            self.stats.bad_mac += 1
            return
        group = session.fanout.get(msg.lease) if self._groups else None
        if group is not None and req.request_id in group.members:
            self._group_verdict(now, session, group, verdict)
            return
        if not self._apply_verdict(now, req, part, verdict):
            self.stats.unexpected_frames += 1

    def _apply_verdict(
        self, now: float, req: Request, part: Part, verdict: wire.DoneVerdict
    ) -> bool:
        """What the DoneAck table says one part does with ``verdict``; False when the
        table gives it nothing to do (the caller counts or skips that)."""
        action = done_ack_action(part.state, verdict)
        if action is DoneAckAction.REMEMBER_HELD:
            part.state = read_next(part.state, _ON_ACK_HELD)
            part.early_held = True
        elif action is DoneAckAction.CONFIRM:
            self._held(req, part)
        elif action is DoneAckAction.FENCE:
            self.stats.fenced += 1
            late = verdict is wire.DoneVerdict.LATE
            self._fail(now, req, FailReason.FENCED_LATE if late else FailReason.REFUSED)
        else:
            return False
        return True

    # ------------------------------------------------------------ fan-out

    def _shared(
        self, now: float, req: Request, sessions: tuple[Session, ...], readers: int
    ) -> bool:
        """Whether ``req`` joined another request reading its ticket (:meth:`_join`).
        When it is the first of ``readers`` > 1, its group is made now: its read then
        does not carry the lease's done while siblings still on their way have not read."""
        lease = req.ticket.lease
        first = sessions[0].by_lease.get(lease)
        if first is not None and self._join(now, req, first, sessions, readers=readers):
            return True
        if readers > 1 and lease not in sessions[0].fanout:
            sessions[0].fanout[lease] = Fanout([req.request_id], expected=readers)
            self._groups += 1
        return False

    def _join(
        self,
        now: float,
        req: Request,
        first_id: str,
        sessions: tuple[Session, ...],
        *,
        parked: bool = False,
        readers: int = 1,
    ) -> bool:
        """``req`` reads the lease ``first_id`` reads (the same ticket): share its claim and
        heartbeats (:class:`~kvproto.reader_session.Fanout`). False if it is not that lease
        (lease ids repeat across holder incarnations) or that request failed: the caller
        then tracks ``req`` alone."""
        first = self._requests.get(first_id)
        if first is None or first.failed or first.ticket.token != req.ticket.token:
            return False
        lease = req.ticket.lease
        fanout = sessions[0].fanout
        group = fanout.get(lease)
        if group is None:
            # The first read alone: a read it began already carried the lease's done.
            group = fanout[lease] = Fanout(
                [first_id], done_sent={r for r, p in first.parts.items() if p.done_frame}
            )
            self._groups += 1
        group.expected = max(group.expected, readers)
        rid = req.request_id
        if rid not in group.members:
            group.members.append(rid)
            group.joined += 1
            self.stats.fanout_joins += 1
        for session in sessions:
            self._copy_claim(first.parts[session.rank], req.parts[session.rank])
        if group.done_sent and not parked:
            # The lease's done went already: this reader rank is finished with it, and
            # that done's verdict cannot cover a read begun now.
            self.stats.fanout_late_reads += 1
            self._fail(now, req, FailReason.LEASE_LOST)
        return True

    @staticmethod
    def _copy_claim(src: Part, dst: Part) -> None:
        """A sibling shares the lease's claim: what its acknowledgement proved is its too."""
        dst.lower_bound = max(dst.lower_bound, src.lower_bound)
        if src.claimed_seq < dst.claimed_seq:
            dst.claimed_seq = src.claimed_seq
            dst.state = read_next(dst.state, _ON_CLAIM_ACKED)

    def _siblings(self, group: Fanout, rid: str) -> list[Request]:
        """The other tracked requests reading ``group``'s lease."""
        requests = self._requests
        return [requests[m] for m in group.members if m != rid and m in requests]

    def _group(self, session: Session, req: Request) -> Fanout | None:
        """``req``'s lease's group on ``session``'s engine, if ``req`` is in one."""
        group = session.fanout.get(req.ticket.lease)
        return group if group is not None and req.request_id in group.members else None

    def _group_of(self, req: Request) -> Fanout | None:
        fanout = self._fanout.get(req.ticket.holder_engine)
        group = None if not fanout else fanout.get(req.ticket.lease)
        return group if group is not None and req.request_id in group.members else None

    def _others_need(
        self, group: Fanout, req: Request, rank: int, states: frozenset[ReadState]
    ) -> bool:
        """Whether a sibling of ``req`` is, towards holder ``rank``, in one of ``states``."""
        return any(
            not sib.failed and sib.parts[rank].state in states
            for sib in self._siblings(group, req.request_id)
        )

    def _last_reader(self, group: Fanout, req: Request, rank: int) -> bool:
        """``req`` begins the last read of its lease from ``rank``: every expected reader
        joined and no sibling is still to read."""
        return group.joined >= group.expected and not self._others_need(
            group, req, rank, _STILL_READS
        )

    def _done_goes(self, now: float, group: Fanout, rank: int, frame: bytes) -> None:
        """The lease's done for ``rank`` leaves now: the landed siblings await its verdict."""
        group.done_sent.add(rank)
        requests = self._requests
        for rid in group.members:
            sib = requests.get(rid)
            if sib is None or sib.failed:
                continue
            part = sib.parts[rank]
            if part.state is _AWAITING_ACK and not part.done_frame:
                part.done_frame = frame
                self._dones.expect(now, sib, part)

    def _settle(
        self, now: float, group: Fanout, session: Session, rank: int, *, force: bool = False
    ) -> None:
        """Send the lease's done to ``rank`` once no reader of it is still reading from it.

        A landed read's done is held back while a sibling has not begun its read (or not
        even joined: fewer than ``group.expected`` have), for at most ``ack_timeout``
        (``force``: that ran out; the done goes without it)."""
        if rank in group.done_sent:
            return
        landed: list[tuple[Request, Part]] = []
        unstarted = group.joined < group.expected
        for rid in group.members:
            sib = self._requests.get(rid)
            if sib is None or sib.failed:
                continue
            part = sib.parts[rank]
            if part.state is _READING:
                return  # its landing settles the group
            if part.state is _AWAITING_ACK:
                landed.append((sib, part))
            elif part.state in _UNSTARTED:
                unstarted = True
        if not landed:
            return
        if unstarted and not force:
            for sib, part in landed:
                if part.ack_deadline == math.inf:
                    self._dones.hold_back(now, sib, part)
            return
        if unstarted:
            self.stats.fanout_done_timeouts += 1
        frame = done_frame(landed[0][0], session.up)
        self._release_lease(now, session, landed[0][0].ticket.lease)
        self._out.append(SendFrame(peer=session.peer, payload=frame))
        self._done_goes(now, group, rank, frame)

    def _held_back_ran_out(self, now: float, req: Request, rank: int) -> None:
        session = self._sessions[(req.ticket.holder_engine, rank)]
        group = self._group(session, req)
        if group is None:
            self._fail(now, req, FailReason.FENCED_NO_ACK)  # not reached: held back in a group
            return
        self._settle(now, group, session, rank, force=True)
        part = req.parts[rank]
        if not part.done_frame and part.ack_deadline <= now:
            # A sibling's read is under way: its landing settles the group (and holds the
            # done back again if one has still not begun).
            part.ack_deadline = math.inf
            self._dones.forget(req.request_id, rank)

    def _group_verdict(
        self, now: float, session: Session, group: Fanout, verdict: wire.DoneVerdict
    ) -> None:
        """The lease's done was answered: the verdict is every sibling's whose read it covers
        (the done left once their reads had landed); one held back still waits."""
        acted = False
        for rid in list(group.members):
            sib = self._requests.get(rid)
            part = None if sib is None else sib.parts.get(session.rank)
            if sib is None or part is None or not part.done_frame:
                continue
            if self._apply_verdict(now, sib, part, verdict):
                acted = True
        if not acted:
            self.stats.unexpected_frames += 1

    def _release_lease(self, now: float, session: Session, lease: int) -> None:
        """Stop heartbeating a group's lease (whichever of its readers the set names)."""
        owner = session.beats.leases.owner(lease)
        if owner is not None:
            self._release(now, session, lease, owner)

    def _leave(self, req: Request) -> None:
        """``req`` left: out of its lease's group; the set and index name a sibling now."""
        engine, lease, rid = req.ticket.holder_engine, req.ticket.lease, req.request_id
        fanout = self._fanout.get(engine)
        group = None if not fanout else fanout.get(lease)
        if group is None or rid not in group.members:
            return
        group.members.remove(rid)
        index = self._by_lease[engine]
        if not group.members:
            del fanout[lease]  # type: ignore[union-attr]
            self._groups -= 1
            return
        heir = group.members[0]
        if index.get(lease) == rid:
            index[lease] = heir
        for rank in req.parts:
            beats = self._sessions[(engine, rank)].beats
            if beats.leases.owner(lease) == rid:
                beats.leases.add(lease, heir)  # the same id: count and digest stay

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
        if first is not None and first != req.request_id and lease in session.beats.leases:
            group = session.fanout.get(lease)
            if group is not None and req.request_id in group.members:
                head = self._requests.get(first)
                if head is not None:
                    self._copy_claim(head.parts[session.rank], req.parts[session.rank])
                return  # joined on another of the engine's sessions already
            if self._join(-math.inf, req, first, (session,), parked=True):
                return
        session.by_lease[lease] = req.request_id
        session.beats.hold(lease, req.request_id, req.proof)

    def _release(self, now: float, session: Session, lease: int, request_id: str) -> bool:
        beats = session.beats
        if beats.leases.owner(lease) != request_id:
            return False  # not held (or the id is another incarnation's request)
        req = self._requests.get(request_id)
        part = None if req is None else req.parts.get(session.rank)
        if req is not None and part is not None:
            # Later in-sync heartbeats no longer cover this lease: keep what the
            # earlier ones proved, and stop deriving anything new from them.
            in_sync = in_sync_bound(req, part, session, now, self._drift)
            part.lower_bound = max(part.lower_bound, in_sync)
        beats.release(lease)
        return True

    def _abort_at(self, now: float, req: Request, rank: int) -> None:
        session = self._sessions[(req.ticket.holder_engine, rank)]
        lease = req.ticket.lease
        if req.request_id in session.parked:
            session.parked.remove(req.request_id)  # never claimed: nothing to abort
            return
        group = self._group(session, req) if self._groups else None
        if group is not None:
            if self._others_need(group, req, rank, _NEEDS_LEASE):
                # A sibling still reads, or awaits the verdict of the lease's done (an
                # abort overtaking that done would fence it): only the last reader aborts.
                self._settle(now, group, session, rank)
                return
            self._release_lease(now, session, lease)
        else:
            self._release(now, session, lease, req.request_id)
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
            else:
                session = self._sessions[(req.ticket.holder_engine, rank)]
                if req.request_id in session.parked:
                    session.parked.remove(req.request_id)
                group = self._group(session, req) if self._groups else None
                if group is None:
                    self._release(now, session, req.ticket.lease, req.request_id)
                elif not self._others_need(group, req, rank, _NEEDS_LEASE):
                    self._release_lease(now, session, req.ticket.lease)
                else:
                    self._settle(now, group, session, rank)
        self._out.append(RequestFailed(request_id=req.request_id, reason=reason))

    def _held(self, req: Request, part: Part) -> None:
        part.state = read_next(part.state, _ON_ACK_HELD)
        self._dones.forget(req.request_id, part.rank)
        if req.confirmed:
            self.stats.reads_confirmed += 1
            self._out.append(ReadConfirmed(request_id=req.request_id))

    def _lease_failed(self, now: float, session: Session, lease: int, reason: FailReason) -> None:
        req, part = self._find(session, lease)
        if req is None or part is None:
            return
        group = session.fanout.get(lease) if self._groups else None
        if group is not None and req.request_id in group.members:
            for sibling in self._siblings(group, req.request_id):
                self._fail(now, sibling, reason)
        self._fail(now, req, reason)

    def _find(self, session: Session, lease: int) -> tuple[Request | None, Part | None]:
        rid = session.by_lease.get(lease)
        req = None if rid is None else self._requests.get(rid)
        return req, None if req is None else req.parts.get(session.rank)

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

    def _pop(self, req: Request) -> None:
        del self._requests[req.request_id]
        index = self._by_lease.get(req.ticket.holder_engine)
        lease = req.ticket.lease
        # Lease ids repeat across holder incarnations: the entry may be a newer request's.
        if index is not None and index.get(lease) == req.request_id:
            group = self._group_of(req) if self._groups else None
            if group is None or len(group.members) <= 1:
                del index[lease]  # else _leave names a sibling in it
