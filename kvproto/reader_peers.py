"""The reader's sessions with holders: their table, their life cycle and the frames that move it.

One :class:`HolderSessions` per reader. It makes a
:class:`~kvproto.reader_session.Session` the first time a ticket routes to a
holder rank, asks the binding to connect it, says Hello (again on a timer or a
``NO_SESSION`` reject, until a Welcome comes), sends the heartbeats its timer
(:mod:`kvproto.reader_timers`) makes due, and breaks it when the peer is lost,
the connect fails or the holder rejects it. Which session state comes next is
the Session's and :mod:`kvproto.states`'s to say; this module only drives it.

It is apart from the reader because a session's life is a concern of its own,
keyed by holder and peer, not by request. The reader keeps the requests: as
with :class:`~kvproto.reader_requests.Deferrals` and
:class:`~kvproto.reader_dones.AwaitedDones`, what changes one is the reader's,
handed in as callbacks, here once at construction as every path needs them:
``fail`` a request, ``attach`` one's lease to a session, and ``awaiting``, the
requests whose dones a broken session leaves unanswered.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

from kvproto import wire
from kvproto.events import Connect, FailReason, ReaderOutput, SendFrame
from kvproto.reader_requests import Request, SessionKey
from kvproto.reader_session import Fanout, ReaderSide, Session, WelcomeProblem
from kvproto.reader_timers import SessionTimers
from kvproto.states import SessionState
from kvproto.stats import ReaderStats
from kvproto.ticket import LeaseTicket
from kvproto.tpmath import holder_ranks
from kvproto.transport import PeerId

_HELLO_SENT = SessionState.HELLO_SENT  # module constants: see kvproto.reader
_OPEN = SessionState.OPEN
_NEVER = math.inf
_ROUTES_KEEP = 1024

Fail = Callable[[float, Request, FailReason], None]
"""Fail a request (``now``, the request, why): the reader's bookkeeping."""


class HolderSessions:
    """The reader's sessions, by holder rank and by peer. See the module docstring."""

    def __init__(
        self,
        side: ReaderSide,
        requests: Mapping[str, Request],
        table: dict[SessionKey, Session],
        *,
        stats: ReaderStats,
        entropy: Callable[[int], bytes],
        fail: Fail,
        attach: Callable[[Session, Request], None],
        awaiting: Callable[[Session], Iterable[Request]],
    ) -> None:
        self._side = side
        self._requests = requests
        self.stats = stats
        """The reader's counters (``Reader.stats``)."""
        self._entropy = entropy
        self._fail = fail
        self._attach = attach
        self._awaiting = awaiting
        self._budget = side.config.frame_budget  # a property of a frozen config: read once
        self.table = table
        """(holder engine, holder rank) → its session, shared with the reader (which reads
        it); sessions are made here only (:meth:`route`)."""
        self.by_peer: dict[PeerId, list[Session]] = {}
        """Peer → the sessions connected through it, latest last (it hears the frames)."""
        self.timers = SessionTimers()
        self.out: list[ReaderOutput] = []
        """The reader's output list: the reader points this at its new one on each drain."""
        self.by_lease: dict[str, dict[int, str]] = {}
        """Holder engine → its sessions' shared :attr:`Session.by_lease` (the reader's
        index of requests by lease id; it keeps it, this only makes one per engine)."""
        self.fanout: dict[str, dict[int, Fanout]] = {}
        """Holder engine → its sessions' shared :attr:`Session.fanout`."""
        self.routes: dict[tuple[str, int], tuple[Session, ...]] = {}
        """(holder engine, holder TP size) → the sessions a ticket of it is tracked on, in
        holder rank order (empty: the TP sizes do not divide); filled by :meth:`route`,
        read directly by the reader's track, which looks it up before calling it."""

    # ------------------------------------------------------------ table

    def route(self, ticket: LeaseTicket) -> tuple[Session, ...]:
        """The sessions ``ticket``'s request is tracked on (cached); () if the TP sizes do
        not divide."""
        key = (ticket.holder_engine, ticket.holder_tp_size)
        route = self.routes.get(key)
        if route is None:
            side = self._side
            ranks = holder_ranks(side.rank, side.tp_size, ticket.holder_tp_size)
            route = tuple(self._session(ticket.holder_engine, r) for r in ranks)
            if len(self.routes) < _ROUTES_KEEP:  # tickets are peer data: bound the cache
                self.routes[key] = route
        return route

    def _session(self, engine: str, rank: int) -> Session:
        session = self.table.get((engine, rank))
        if session is None:
            by_lease = self.by_lease.setdefault(engine, {})
            session = Session(
                self._side,
                engine=engine,
                rank=rank,
                serial=len(self.table),
                by_lease=by_lease,
                fanout=self.fanout.setdefault(engine, {}),
            )
            self.table[(engine, rank)] = session
        return session

    def need(self, session: Session) -> None:
        """A request is tracked on ``session``: ask the binding to connect it if it is not."""
        if session.need():
            self.out.append(Connect(engine=session.engine, rank=session.rank))

    # ------------------------------------------------------------ life cycle

    def connected(self, now: float, session: Session, peer: PeerId) -> None:
        """The binding reached ``session``'s holder as ``peer``: say Hello."""
        if not session.connected():
            self.stats.stale_connects += 1
            return
        if session.peer != peer:
            if session.peer:
                self.by_peer[session.peer].remove(session)
            session.peer = peer
            self.by_peer.setdefault(peer, []).append(session)
        self.hello(now, session)

    def peer_lost(self, now: float, peer: PeerId) -> None:
        """``peer`` is gone, and the blocks its holders kept with it."""
        for session in list(self.by_peer.get(peer, ())):
            self.break_(now, session, FailReason.LEASE_LOST)

    def break_(self, now: float, session: Session, reason: FailReason) -> None:
        """The session is gone: every request it kept, or awaits a done for, fails."""
        held = session.lost()
        self.timers.schedule(session, _NEVER)
        for rid in held:
            req = self._requests.get(rid)
            if req is not None:
                self._fail(now, req, reason)
        session.parked.clear()
        for req in self._awaiting(session):
            self._fail(now, req, reason)

    def serve(self, now: float) -> None:
        """Do the sessions' due timer work: re-Hello the unwelcomed, heartbeat the open."""
        for session in self.timers.due(now):
            if session.beats.next_beat > now:
                continue  # rescheduled by an earlier session's work
            if session.state is _HELLO_SENT:
                self._fail_lapsed(now, session)
                self.hello(now, session)
            elif session.state is _OPEN:
                self.beat(now, session)
            else:
                self.timers.schedule(session, _NEVER)

    def _fail_lapsed(self, now: float, session: Session) -> None:
        """Unwelcomed, fail the requests whose lease lapsed (:meth:`Session.lapsed`)."""
        for rid in session.lapsed(now, self._requests):
            self._fail(now, self._requests[rid], FailReason.LEASE_LOST)

    def hello(self, now: float, session: Session) -> None:
        """Say Hello, and again after an interval if no Welcome came by then."""
        self.timers.schedule(session, now + session.interval(self._requests))
        payload = session.hello(now, self._entropy(16), session.anchor(self._requests))
        if payload is not None:
            self.out.append(SendFrame(peer=session.peer, payload=payload))

    def rehello(self, now: float, session: Session) -> None:
        """The holder does not know this session (any more): Hello again, re-claim all."""
        session.rejected(self.proof_of)
        self.hello(now, session)

    def beat(self, now: float, session: Session) -> int:
        """Send this tick's heartbeat(s) (:meth:`kvproto.beats.Beats.frames`); how many."""
        beats = session.beats
        params = session.params
        if beats.leases.count or beats.pending_aborts:
            interval = params.interval if params is not None else session.interval(self._requests)
            self.timers.schedule(session, now + interval)
        else:
            self.timers.schedule(session, _NEVER)
        if beats.want_full:
            self.stats.resyncs += 1
        stats, out, peer = self.stats, self.out, session.peer
        sent = 0
        for payload in beats.frames(
            now, key=session.up, budget=self._budget, proof_of=self.proof_of
        ):
            sent += 1
            stats.heartbeat_bytes += len(payload)
            out.append(SendFrame(peer=peer, payload=payload))
        stats.heartbeats_sent += sent
        return sent

    def proof_of(self, request_id: str) -> bytes:
        """The claim proof of a tracked request."""
        return self._requests[request_id].proof

    # ------------------------------------------------------------ frames

    def on_welcome(self, now: float, session: Session, msg: wire.Welcome, data: bytes) -> None:
        """The holder welcomed the session: fail the requests it outlived, claim the rest."""
        problem = session.welcome(now, msg, data)
        if problem is not None:
            if problem is WelcomeProblem.BAD_MAC:
                self.stats.bad_mac += 1
            else:
                self.stats.unexpected_frames += 1
            return
        beats = session.beats
        for lease, rid in list(beats.leases.items()):
            req = self._requests.get(rid)
            reason = None if req is None else session.welcomed_verdict(now, req.ticket)
            if req is not None and reason is not None:
                group = session.fanout.get(lease) if session.fanout else None
                for member in [rid] if group is None else list(group.members):
                    sibling = self._requests.get(member)
                    if sibling is not None:
                        self._fail(now, sibling, reason)
            else:
                beats.pending_claims.setdefault(lease, self.proof_of(rid))
        parked, session.parked = session.parked, []
        for rid in parked:
            req = self._requests.get(rid)
            if req is None or req.failed:
                continue
            reason = session.welcomed_verdict(now, req.ticket)
            if reason is not None:
                self._fail(now, req, reason)
            else:
                self._attach(session, req)
        self.beat(now, session)  # at once: vLLM dropped the heartbeat of the handshake tick

    def on_reject(self, now: float, session: Session, msg: wire.Reject) -> None:
        """The holder rejected a frame: Hello again if it lost the session, else give up."""
        self.stats.rejects += 1
        if msg.reason == wire.RejectReason.NO_SESSION:
            self.rehello(now, session)
        else:
            self.break_(now, session, FailReason.CONNECT_FAILED)
