"""The holder's bookkeeping: its leases, their gauges and deadlines, the sessions renewing them.

One :class:`LeaseBook` per holder, shared by the holder's parts (sessions and
keying, claims, dones, stock peers: :mod:`kvproto.holder`). It is the one place
a lease moves: :meth:`LeaseBook.transition` takes the lease table's row
(:data:`~kvproto.holder_leases.NEXT_STATE`, derived from
:data:`~kvproto.states.LEASE_TRANSITIONS`) and keeps the gauges of live leases
by state; :meth:`LeaseBook.end` frees a lease (detaches its sessions, counts
why, tells the binding, keeps a tombstone). It also keeps the two expiry
queues, the sessions by serial and the outputs the binding drains.

A lease's deadline is the latest of its own and those of the sessions renewing
it (:meth:`LeaseBook.live_until`), capped by its hard deadline; a session that
stops renewing a lease hands it its deadline (:meth:`LeaseBook.detach`), so a
lease never lapses earlier than a heartbeat promised.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable

from kvproto import auth, wire
from kvproto.config import LeaseConfig
from kvproto.events import FreeBlocks, HolderOutput, ReleaseReason, SendFrame, WriteFenced
from kvproto.holder_leases import (
    GRANTED,
    HELD,
    NEXT_STATE,
    NO_ROW,
    STATES,
    TERMINAL,
    UNSCHEDULED,
    LeaseTable,
)
from kvproto.holder_members import NOBODY, SEVERAL, SessionLeases
from kvproto.holder_timers import DeadlineQueue
from kvproto.holder_writes import WriteFence
from kvproto.ratelimit import ReplayWindow, TokenBucket
from kvproto.states import LeaseInput, lease_next
from kvproto.stats import HolderStats
from kvproto.ticket import LeaseTicket, claim_message
from kvproto.transport import PeerId

_END_STATE_COUNTER = {
    ReleaseReason.DONE: "released_done",
    ReleaseReason.EXPIRED: "expired",
    ReleaseReason.ABORTED: "aborted",
    ReleaseReason.REVOKED: "revoked",
    ReleaseReason.MAX_HOLD: "max_hold",
    ReleaseReason.PEER_LOST: "peer_lost",
}

# Enum members the per-lease paths (claim, done, expiry, abort, loss) use, read once:
# reading a member off its class goes through EnumType's ``__getattr__`` hook (~1k
# instructions), more than the rest of a transition.
_IN_DEADLINE = LeaseInput.DEADLINE
_IN_PEER_LOST = LeaseInput.PEER_LOST
_FREED_EXPIRED = ReleaseReason.EXPIRED
_FREED_MAX_HOLD = ReleaseReason.MAX_HOLD
_FREED_PEER_LOST = ReleaseReason.PEER_LOST

NEVER_RENEWED = -math.inf
"""A session's deadline before its first heartbeat."""


class PeerSession:
    """The holder's session with one reader rank (one transport peer)."""

    __slots__ = (
        "attempt",
        "bucket",
        "claim_message",
        "deadline",
        "down",
        "engine",
        "expected",
        "heap_due",
        "hello_nonce",
        "incarnation",
        "leases",
        "peer",
        "prev_up",
        "rank",
        "serial",
        "server_nonce",
        "tp_size",
        "up",
        "verdict_prover",
        "window",
    )

    def __init__(
        self,
        serial: int,
        peer: PeerId,
        hello: wire.Hello,
        bucket: TokenBucket,
        leases: SessionLeases,
    ) -> None:
        self.serial = serial
        self.peer = peer
        self.engine = hello.engine
        self.rank = hello.rank
        self.tp_size = hello.tp_size
        self.expected = 0
        self.incarnation = hello.incarnation
        self.attempt = hello.attempt
        # Directional session keys (kvproto.auth); the previous reader key stays
        # valid so a done riding a READ that crossed a re-key is not lost.
        self.up = b""
        self.down = b""
        self.prev_up = b""
        self.bucket = bucket
        self.hello_nonce = hello.nonce
        self.server_nonce = b""
        self.deadline = NEVER_RENEWED
        self.heap_due: float | None = None
        self.window = ReplayWindow()
        self.leases = leases
        # The session's claim proofs' message and its verdict proofs, each packed per
        # lease: the engine and rank never change for a session (a Hello naming others
        # is refused).
        self.claim_message = claim_message(hello.engine)
        self.verdict_prover = auth.verdict_prover(hello.engine, hello.rank)


class LeaseBook:
    """The holder's leases and what keeps them. See the module docstring."""

    __slots__ = (
        "by_serial",
        "config",
        "fence",
        "granted",
        "held",
        "lease_deadlines",
        "leases",
        "out",
        "session_heap",
        "stats",
        "tombstones",
    )

    def __init__(self, config: LeaseConfig, stats: HolderStats) -> None:
        self.config = config
        self.stats = stats
        self.leases = LeaseTable()
        self.lease_deadlines = DeadlineQueue()
        """Leases on their own or hard deadline (each lease at most one canonical entry)."""
        self.session_heap: list[tuple[float, int]] = []
        """(deadline, serial) of sessions that renew leases (one canonical entry each)."""
        self.by_serial: dict[int, PeerSession] = {}
        self.tombstones: deque[tuple[float, int]] = deque()
        """(forget at, lease id) of ended leases, oldest first."""
        self.granted = 0  # live leases by state, kept as plain ints (Enum hashing is slow)
        self.held = 0
        self.out: list[HolderOutput] = []
        self.fence = WriteFence()
        """Writable leases (push mode) and their armed writers (spec/push-mode.md)."""

    # ------------------------------------------------------------ leases

    def hold(self, now: float, ticket: LeaseTicket, *, writable: bool = False) -> None:
        """Hold a lease the holder granted or adopted (its caller refused what it must);
        ``writable``: its reader writes the blocks (push mode)."""
        slot = self.leases.add(ticket, now, self.config.max_hold)
        self.granted += 1
        self.stats.grants += 1
        if writable:
            self.fence.writable.add(ticket.lease)
        self.schedule_lease(slot)

    def transition(self, slots: Iterable[int], event: LeaseInput) -> None:
        """``event`` to each lease of ``slots``, in order: the lease table's row decides
        each next state (raising where it has none), the gauges follow. The one place a
        lease's state is written; the claim path hands it a frame's claims at once."""
        states = self.leases.states
        row = NEXT_STATE[event._value_]
        granted, held = self.granted, self.held  # in locals: the claim path's loop
        try:
            for slot in slots:
                old = states[slot]
                new = row[old]
                if new != old:
                    if new == NO_ROW:
                        lease_next(STATES[old], event)  # raises: the lease table has no such row
                    if old == GRANTED:
                        granted -= 1
                    else:
                        held -= 1
                    if new == HELD:
                        held += 1
                    states[slot] = new
        finally:
            self.granted, self.held = granted, held

    def end(self, now: float, slot: int, event: LeaseInput, reason: ReleaseReason) -> None:
        """End the lease by ``event``: its sessions let go, the binding frees its blocks."""
        self.transition((slot,), event)
        members = self.leases.members
        if members.holder[slot] != NOBODY:
            for serial in members.holders(slot):
                self.detach(slot, self.by_serial[serial], fall_back=False)
        counter = _END_STATE_COUNTER[reason]
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        lease_id = self.leases.ids[slot]
        request_id = self.leases.request_id(slot)
        writable = self.fence.writable
        if writable and lease_id in writable and self.fence.end(lease_id, reason):
            # A writer may still write into the blocks: not used, not reused, and not
            # forgotten (its done or abort must find it) until the last disarm.
            self.stats.write_fenced += 1
            self.out.append(WriteFenced(lease=lease_id, request_id=request_id, reason=reason))
            return
        self.out.append(FreeBlocks(lease=lease_id, request_id=request_id, reason=reason))
        self.tombstone(now, lease_id)

    def tombstone(self, now: float, lease_id: int) -> None:
        """Remember an ended lease for late frames, for ``tombstone_ttl`` (and a cap)."""
        self.tombstones.append((now + self.config.tombstone_ttl, lease_id))
        if len(self.tombstones) > self.config.max_tombstones:
            self.leases.forget(self.tombstones.popleft()[1])

    # ------------------------------------------------------------ the write fence

    def disarm(self, now: float, lease_id: int, serial: int) -> None:
        """Session ``serial`` can write no more into ``lease_id`` (push mode): settle it if
        it was the last writer of a quarantined lease."""
        reason = self.fence.disarm(lease_id, serial)
        if reason is not None:
            self.settle(now, lease_id, reason)

    def disarm_session(self, now: float, serial: int) -> None:
        """Session ``serial``'s peer was lost: it can write into nothing any more."""
        if self.fence.is_armed(serial):
            for lease_id, reason in self.fence.disarm_session(serial):
                self.settle(now, lease_id, reason)

    def settle(self, now: float, lease_id: int, reason: ReleaseReason) -> None:
        """A quarantined lease's last writer was disarmed: its blocks may be reused now."""
        slot = self.leases.slot(lease_id)
        request_id = "" if slot is None else self.leases.request_id(slot)
        self.out.append(FreeBlocks(lease=lease_id, request_id=request_id, reason=reason))
        self.tombstone(now, lease_id)

    def live_until(self, slot: int) -> float:
        """The latest of the lease's own deadline and its sessions' (not capped by hard)."""
        table = self.leases
        until = table.own[slot]
        held = table.members.holder[slot]
        if held == NOBODY:
            return until
        if held != SEVERAL:
            return max(until, self.by_serial[held].deadline)
        for serial in table.members.holders(slot):
            until = max(until, self.by_serial[serial].deadline)
        return until

    # ------------------------------------------------------------ sessions

    def attach(self, slot: int, session: PeerSession) -> None:
        """``session`` renews the lease from now on."""
        self.leases.members.attach(slot, session.leases, self.leases.ids[slot])
        if session.heap_due is None and session.deadline != NEVER_RENEWED:
            self.schedule_session(session)

    def detach(self, slot: int, session: PeerSession, *, fall_back: bool = True) -> None:
        """Take the lease out of ``session``; it keeps what the session had given it."""
        table = self.leases
        table.members.detach(slot, session.leases, table.ids[slot])
        if fall_back and not TERMINAL[table.states[slot]]:
            table.own[slot] = max(table.own[slot], session.deadline)
            if table.members.holder[slot] == NOBODY:
                self.schedule_lease(slot)

    def forget_session(self, now: float, session: PeerSession, *, lost: bool) -> None:
        """Let go of every lease of ``session``; ``lost``: end those only it renewed."""
        # Out of the serial index last: the leases it renews name it until detached.
        for slot in self.leases.members.slots(session.leases):
            if lost and self.leases.members.holder[slot] == session.serial:
                self.end(now, slot, _IN_PEER_LOST, _FREED_PEER_LOST)
            else:
                # Another session (another reader rank) still holds it: the lease keeps
                # what this one had given it, or its deadline would move earlier (S2).
                self.detach(slot, session)
        self.close_session(session)

    def close_session(self, session: PeerSession) -> None:
        """Drop a session that renews nothing (any more)."""
        self.leases.members.close(session.leases)
        self.by_serial.pop(session.serial, None)

    # ------------------------------------------------------------ deadlines

    def schedule_lease(self, slot: int) -> None:
        """File the lease's canonical expiry entry unless an earlier one is filed."""
        table = self.leases
        due = table.hard[slot]
        if table.members.holder[slot] == NOBODY:
            own = table.own[slot]
            due = own if own < due else due  # min(own, hard), without the call
        if table.due[slot] <= due:  # False while UNSCHEDULED (NaN)
            return  # the earlier canonical entry will fire and re-schedule
        table.due[slot] = due
        self.lease_deadlines.push(due, table.ids[slot])

    def schedule_session(self, session: PeerSession) -> None:
        """File the session's canonical keep-alive entry at its deadline."""
        session.heap_due = session.deadline
        heapq.heappush(self.session_heap, (session.deadline, session.serial))

    def expire_sessions(self, now: float) -> None:
        """Sessions whose keep-alive passed by ``now`` let go of their leases."""
        heap = self.session_heap
        while heap and heap[0][0] <= now:
            due, serial = heapq.heappop(heap)
            session = self.by_serial.get(serial)
            if session is None or session.heap_due != due:
                continue
            session.heap_due = None
            if session.deadline > now:
                if session.leases.count:
                    self.schedule_session(session)
            else:
                for held in self.leases.members.slots(session.leases):
                    self.detach(held, session)

    def expire_leases(self, now: float) -> None:
        """End every lease whose deadline (own, sessions', hard) passed by ``now``."""
        table = self.leases
        # Ending or re-scheduling a lease here never schedules anything due by now.
        for due, lease_id in self.lease_deadlines.take_due(now):
            slot = table.slot(lease_id)
            if slot is None or table.due[slot] != due or TERMINAL[table.states[slot]]:
                continue
            table.due[slot] = UNSCHEDULED
            if now >= table.hard[slot]:
                self.send_revoke(slot, _FREED_MAX_HOLD)
                self.end(now, slot, _IN_DEADLINE, _FREED_MAX_HOLD)
            elif self.live_until(slot) <= now:
                self.end(now, slot, _IN_DEADLINE, _FREED_EXPIRED)
            else:
                self.schedule_lease(slot)

    def forget_tombstones(self, now: float) -> None:
        """Forget the ended leases whose tombstone lapsed by ``now``."""
        tombstones = self.tombstones
        while tombstones and tombstones[0][0] <= now:
            self.leases.forget(tombstones.popleft()[1])

    # ------------------------------------------------------------ outputs

    def send_revoke(self, slot: int, reason: ReleaseReason) -> None:
        """Tell every session renewing the lease that it ends for ``reason``."""
        lease_id = self.leases.ids[slot]
        for serial in self.leases.members.holders(slot):
            revoke = wire.Revoke(leases=[lease_id], reason=int(reason))
            self.send_session(self.by_serial[serial], revoke)

    def send_session(self, session: PeerSession, msg: wire.Message) -> None:
        """Send ``msg`` to the session's reader, signed with the holder's session key."""
        self.out.append(SendFrame(peer=session.peer, payload=wire.encode(msg, session.down)))

    def send_keyed(self, peer: PeerId, key: bytes, msg: wire.Message) -> None:
        """Send ``msg`` to ``peer`` signed with ``key``."""
        self.out.append(SendFrame(peer=peer, payload=wire.encode(msg, key)))

    def send_plain(self, peer: PeerId, msg: wire.Message) -> None:
        """Send ``msg`` to ``peer`` signed with the shared secret only (if any)."""
        self.out.append(SendFrame(peer=peer, payload=wire.encode(msg, self.config.auth_secret)))
