"""The holder's heartbeat path: a session's renewal, its claims, aborts and resyncs, the ack.

Every heartbeat renews its session (O(1)); the claims it carries are the one
per-lease cost of getting a lease into a session, so :meth:`Claims.check`
keeps the columns of the :class:`~kvproto.holder_leases.LeaseTable` in locals
and does inline what the table's :meth:`~kvproto.holder_leases.LeaseTable.slot`
and :meth:`~kvproto.holder_leases.LeaseTable.owner` and the claim prover
(:func:`kvproto.ticket.claim_prover`, its message's engine part packed once a
session) do. That is the one fast path with a twin here: tests/core/test_proofs.py
holds it to a reference written with those methods, on random tables and frames.
The claimed leases then move through :meth:`~kvproto.holder_book.LeaseBook.transition`,
the lease table's rows, like every other lease.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from kvproto import wire
from kvproto.events import ReleaseReason
from kvproto.holder_book import NEVER_RENEWED, LeaseBook, PeerSession
from kvproto.holder_claimers import UNCLAIMED
from kvproto.holder_leases import TERMINAL
from kvproto.states import LeaseInput, lease_next
from kvproto.ticket import PROOF_BYTES, TOKEN_BYTES

# Enum members read once (see kvproto.holder_book).
_IN_CLAIM = LeaseInput.CLAIM
_IN_ABORT = LeaseInput.ABORT
_FREED_ABORTED = ReleaseReason.ABORTED


class Claims:
    """Applies a session's heartbeats. See the module docstring."""

    __slots__ = ("_ack_room", "_book", "_config", "_extension", "_stats")

    def __init__(self, book: LeaseBook) -> None:
        self._book = book
        self._stats = book.stats
        config = book.config
        self._config = config
        # Read on every heartbeat; the config is frozen, and these are computed from it.
        self._extension = config.lease_extension
        self._ack_room = wire.frame_room(config.frame_budget, wire.HELD_BYTES)
        """``HeartbeatAck.held`` and ``lost`` items one ack frame has room for."""

    def on_heartbeat(self, now: float, session: PeerSession, hb: wire.Heartbeat) -> None:
        """Renew the session, apply what the heartbeat carries and acknowledge it."""
        stats = self._stats
        n_ids = len(hb.claims) + len(hb.aborts) + (len(hb.full) if hb.full is not None else 0)
        if n_ids > self._config.max_ids_per_frame:
            stats.limit_refusals += 1
            return
        if not session.window.plausible(hb.seq):
            stats.implausible_seq += 1
            return
        if not session.window.accept(hb.seq):
            stats.replayed += 1
            return
        stats.heartbeats += 1
        renewed = now + self._extension
        deadline = session.deadline
        session.deadline = renewed if renewed > deadline else deadline  # max, without the call
        if session.leases.count and session.heap_due is None:
            self._book.schedule_session(session)
        lost: list[int] = []
        held = self._claim_all(now, session, hb.claims, lost) if hb.claims else []
        for claim in hb.aborts:
            self._abort(now, session, claim)
        if hb.full is not None:
            self._resync(session, hb.full, lost)
        leases = session.leases
        resync = hb.full is None and (leases.count != hb.count or leases.digest != hb.digest)
        if resync:
            stats.resyncs += 1
        self._send_acks(session=session, seq=hb.seq, now=now, held=held, lost=lost, resync=resync)

    def _send_acks(
        self,
        *,
        session: PeerSession,
        seq: int,
        now: float,
        held: list[tuple[int, float]],
        lost: list[int],
        resync: bool,
    ) -> None:
        # held first, then lost, as one list cut to the frame budget.
        book = self._book
        room = self._ack_room
        n_held = len(held)
        if n_held + len(lost) <= room:
            # All in one ack (every steady heartbeat's): the loop below, without the cuts.
            ack = wire.HeartbeatAck(seq=seq, clock=now, held=held, lost=lost, resync=resync)
            book.send_session(session, ack)
            return
        for part in wire.frame_slices(n_held + len(lost), room):
            start, stop = part.start - n_held, part.stop - n_held
            ack = wire.HeartbeatAck(
                seq=seq,
                clock=now,
                held=held[part],
                lost=lost[max(0, start) : max(0, stop)],
                resync=resync,
            )
            book.send_session(session, ack)

    def _claim_all(
        self, now: float, session: PeerSession, claims: list[wire.Claim], lost: list[int]
    ) -> list[tuple[int, float]]:
        """Hold each proven claim for the session: its (lease, seconds left) for the ack;
        the ids of the others go to ``lost``.

        One loop over the frame's claims with the columns in locals: per claim, a
        method call or an attribute read is a sizeable share of what the claim costs
        above its proof (``holder.claim_floor``).
        """
        book = self._book
        table = book.leases
        states, own, hard = table.states, table.own, table.hard
        terminal = TERMINAL
        members = table.members
        holder_col = members.holder
        attach = members.attach
        leases = session.leases
        serial = session.serial
        deadline = session.deadline
        cap = self._config.max_leases_per_session
        held: list[tuple[int, float]] = []
        claimed: list[int] = []
        for claim, slot in zip(claims, self.check(session, claims), strict=True):
            lease = claim.lease
            if slot is None or terminal[states[slot]]:
                lost.append(lease)
                continue
            if leases.count >= cap and not members.holds(slot, serial):
                self._stats.limit_refusals += 1
                lost.append(lease)
                continue
            claimed.append(slot)
            attach(slot, leases, lease)
            # Just attached: renewed by this session alone unless others renew it too.
            # max and min as expressions (a call to either costs more than the claim's
            # other arithmetic); each column read once, as a read boxes a new float.
            if holder_col[slot] == serial:
                until = own[slot]
                until = deadline if deadline > until else until
            else:
                until = book.live_until(slot)
            stop = hard[slot]
            held.append((lease, (stop if stop < until else until) - now))
        # The claims move their leases once the loop is done: nothing in it reads a
        # state the CLAIM row changes (it never ends a lease).
        book.transition(claimed, _IN_CLAIM)
        if claimed and session.heap_due is None and deadline != NEVER_RENEWED:
            book.schedule_session(session)
        return held

    def check(self, session: PeerSession, claims: Sequence[wire.Claim]) -> list[int | None]:
        """Each claim's slot if its proof is right and no other engine owns the lease, else
        None (counted). A live lease nobody owned is the session's engine's from now on.

        The checks of a frame's claims in one loop: nothing they read changes while the
        claims are held (no lease ends or is forgotten), and the session's claimer code
        is taken once, not per lease.
        """
        table = self._book.leases
        home, mask, ids, overflow = table.index()
        owners, states, tokens, terminal = table.claimer, table.states, table.tokens, TERMINAL
        engines = table.claimers.engines
        engine = session.engine
        message = session.claim_message
        blake2b, compare, width = hashlib.blake2b, hmac.compare_digest, TOKEN_BYTES
        stats = self._stats
        code = UNCLAIMED
        new_owned = 0
        slots: list[int | None] = []
        for claim in claims:
            lease = claim.lease
            slot = home[lease & mask]  # table.slot, inline
            if slot < 0 or ids[slot] != lease:
                slot = overflow.get(lease, -1) if overflow else -1
                if slot < 0:
                    stats.unknown_lease += 1
                    slots.append(None)
                    continue
            owner = engines[owners[slot]]  # table.owner, inline
            if owner is not None and owner != engine:
                stats.owner_mismatch += 1
                slots.append(None)
                continue
            # claim_prover(engine)(token, lease), the token sliced from its column
            start = slot * width
            token = tokens[start : start + width]
            proof = blake2b(message(lease), key=token, digest_size=PROOF_BYTES).digest()
            if not compare(proof, claim.proof):
                stats.bad_proof += 1
                slots.append(None)
                continue
            if owner is None and not terminal[states[slot]]:
                if code == UNCLAIMED:
                    code = table.claimers.acquire(engine, session.tp_size, session.expected)
                new_owned += 1
                owners[slot] = code  # table.set_claimer, its code counted below
            slots.append(slot)
        if new_owned > 1:
            table.claimers.retain(code, new_owned - 1)
        stats.claims += new_owned
        return slots

    def _abort(self, now: float, session: PeerSession, claim: wire.Claim) -> None:
        # One claim at a time: ending a lease may forget a tombstoned one a later abort names.
        (slot,) = self.check(session, (claim,))
        if slot is None:
            return
        if self._book.fence.writable:
            # The writer aborts only with no write of it in flight (push mode, W3).
            self._book.disarm(now, claim.lease, session.serial)
        table = self._book.leases
        if table.terminal(slot):
            # an explicit "late" row: stays ended
            lease_next(table.state(slot), _IN_ABORT)
            return
        self._book.end(now, slot, _IN_ABORT, _FREED_ABORTED)

    def _resync(self, session: PeerSession, deltas: list[int], lost: list[int]) -> None:
        book = self._book
        table = book.leases
        wanted = set(wire.delta_decode(deltas))
        slots = {table.ids[slot]: slot for slot in table.members.slots(session.leases)}
        # Built in join order: a set's iteration order follows its insertions, and the
        # detaches and ``lost`` (on the wire) come out in it.
        holding = set(slots)
        for lease_id in holding - wanted:
            book.detach(slots[lease_id], session)
        for lease_id in wanted - holding:
            slot = table.slot(lease_id)
            if (
                slot is None
                or table.terminal(slot)
                or table.owner(slot) != session.engine
                or session.leases.count >= self._config.max_leases_per_session
            ):
                lost.append(lease_id)
            else:
                book.attach(slot, session)
