"""The holder's dones: a reader rank says it has read a lease; the holder answers a verdict.

A done proves its claim as a claim does (:meth:`~kvproto.holder_claims.Claims.check`).
What it is to its lease (:meth:`Dones._done_input`: a done, the last expected
one, a duplicate, one of another TP layout) is an input of the lease table;
the verdict comes from the same table (:func:`kvproto.states.done_verdict`).
Only a HELD verdict vouches for the read, so only it carries a proof
(:func:`kvproto.auth.verdict_prover`, made once a session as
:attr:`~kvproto.holder_book.PeerSession.verdict_prover`).
"""

from __future__ import annotations

from kvproto import wire
from kvproto.events import ReleaseReason
from kvproto.holder_book import LeaseBook, PeerSession
from kvproto.holder_claims import Claims
from kvproto.holder_leases import STATES, TERMINAL
from kvproto.states import LeaseInput, done_verdict
from kvproto.wire import DoneVerdict

# Enum members read once (see kvproto.holder_book).
_IN_DONE = LeaseInput.DONE
_IN_LAST_DONE = LeaseInput.LAST_DONE
_IN_FOREIGN_DONE = LeaseInput.FOREIGN_DONE
_IN_DUPLICATE_DONE = LeaseInput.DUPLICATE_DONE
_FREED_DONE = ReleaseReason.DONE
_VERDICT_HELD = DoneVerdict.HELD
_VERDICT_LATE = DoneVerdict.LATE
_VERDICT_REFUSED = DoneVerdict.REFUSED


class Dones:
    """Answers a session's dones. See the module docstring."""

    __slots__ = ("_book", "_claims", "_stats")

    def __init__(self, book: LeaseBook, claims: Claims) -> None:
        self._book = book
        self._stats = book.stats
        self._claims = claims

    def on_done(self, now: float, session: PeerSession, claim: wire.Claim) -> None:
        """Count the done for its lease (ending it if it is the last) and answer a verdict."""
        self._stats.done_frames += 1
        (slot,) = self._claims.check(session, (claim,))
        # A done proves the claim as a heartbeat claim does: if it arrives first (the
        # heartbeat carrying the claim was lost or delayed), the check has just
        # recorded this session as the first claimer of the live lease, and the done
        # counts as claim + done.
        if slot is not None and self._book.fence.writable:
            # The done rode this session's write, after its data: it can write no more.
            self._book.disarm(now, claim.lease, session.serial)
        verdict = _VERDICT_REFUSED if slot is None else self._apply_done(now, session, slot)
        proof = b""
        if slot is not None and verdict is _VERDICT_HELD:
            proof = session.verdict_prover(self._book.leases.token(slot), claim.lease, verdict)
        ack = wire.DoneAck(lease=claim.lease, verdict=verdict, proof=proof)
        self._book.send_session(session, ack)

    def _done_input(self, session: PeerSession, slot: int) -> LeaseInput:
        """What a proven done is to its lease; the tables decide what it does."""
        table = self._book.leases
        code = table.claimer[slot]  # table.reader_tp and table.expected, read once
        reader_tp = table.claimers.tps[code]
        if reader_tp and reader_tp != session.tp_size:
            # reader_tp is unset only when the lease ended before anyone claimed it:
            # such a done is late, not of another TP layout.
            return _IN_FOREIGN_DONE
        consumers = table.consumers.get(slot)
        if consumers is not None and consumers.get(session.rank) == session.serial:
            # Keyed by session, not by rank: if someone else's done for this rank came
            # first (a replayed Hello without auth_secret), the real reader's done after
            # the free is answered LATE, so its read is fenced instead of trusted.
            return _IN_DUPLICATE_DONE
        if TERMINAL[table.states[slot]]:
            return _IN_DONE
        counted = 0 if consumers is None else len(consumers)
        if consumers is None or session.rank not in consumers:
            counted += 1
        return _IN_LAST_DONE if counted >= table.claimers.expected[code] else _IN_DONE

    def _apply_done(self, now: float, session: PeerSession, slot: int) -> DoneVerdict:
        book, stats = self._book, self._stats
        event = self._done_input(session, slot)
        verdict = done_verdict(STATES[book.leases.states[slot]], event)
        if event is _IN_FOREIGN_DONE:
            stats.bad_rank_done += 1  # not in the expected set: its read is not vouched for
        elif verdict is _VERDICT_LATE:
            stats.late_done += 1
        elif event is _IN_DUPLICATE_DONE:
            stats.duplicate_done += 1  # the answer its first done got
        elif event is _IN_LAST_DONE:
            self._count_consumer(session, slot)
            book.end(now, slot, event, _FREED_DONE)
            return verdict
        else:
            self._count_consumer(session, slot)
            book.transition((slot,), event)
            if book.leases.members.holds(slot, session.serial):
                book.detach(slot, session)
            return verdict
        book.transition((slot,), event)  # a "stay" row
        return verdict

    def _count_consumer(self, session: PeerSession, slot: int) -> None:
        consumers = self._book.leases.consumers.setdefault(slot, {})
        consumers.setdefault(session.rank, session.serial)
