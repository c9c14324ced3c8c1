"""The leases several of a reader's requests read: one ticket, several requests.

vLLM's parallel sampling gives every child of a request the parent's ticket
(``Reader.track(readers=n)``), and any fan-out may do the same. Such a lease is
claimed, heartbeated and aborted once for all its readers (a
:class:`~kvproto.reader_session.Fanout` per lease), and its done goes to each
holder rank once, when no member still reads from it (the Fanout's docstring says
why). :class:`Fanouts` keeps those groups: who joins, which sibling a claim's
acknowledgement also proves, when the lease's one done leaves, which requests its
verdict covers, and who is left heartbeating the lease when a member goes.

It is apart from the reader because it is a concern of its own, keyed by lease,
not by request; the requests stay the reader's. As with
:class:`~kvproto.reader_peers.HolderSessions`, what changes a request is the
reader's, handed in as the ``fail`` callback at construction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from kvproto.events import FailReason, SendFrame
from kvproto.reader_dones import AwaitedDones, done_frame
from kvproto.reader_requests import Part, Request, SessionKey, release
from kvproto.reader_session import Fanout, Session
from kvproto.states import ReadInput, ReadState, read_next
from kvproto.stats import ReaderStats

if TYPE_CHECKING:
    from kvproto.reader_peers import HolderSessions

_AWAITING_ACK = ReadState.AWAITING_ACK  # module constants: see kvproto.reader
_READING = ReadState.READING
_ON_CLAIM_ACKED = ReadInput.CLAIM_ACKED
_UNSTARTED = frozenset({ReadState.TRACKED, ReadState.CLAIMED, ReadState.DEFERRED})
_STILL_READS = _UNSTARTED | {_READING}
"""A lease's reader in these states has still to read it (its lease must stay held)."""
_NEEDS_LEASE = _STILL_READS | {_AWAITING_ACK}
"""... and in these it still needs the lease not aborted (a verdict may be on its way)."""


class Fanouts:
    """The reader's leases read by several requests. See the module docstring."""

    def __init__(
        self,
        requests: dict[str, Request],
        sessions: dict[SessionKey, Session],
        holders: HolderSessions,
        *,
        stats: ReaderStats,
        dones: AwaitedDones,
        drift: float,
        fail: Callable[[float, Request, FailReason], None],
    ) -> None:
        self._requests = requests
        self._sessions = sessions
        self._holders = holders
        """Their ``out`` is the reader's output list (a new one after each drain)."""
        self._fanout = holders.fanout
        """Holder engine → lease id → its readers, for leases several requests read."""
        self._by_lease = holders.by_lease
        """Holder engine → lease id → request id (each engine's sessions share its dict)."""
        self.stats = stats
        self._dones = dones
        self._drift = drift
        self._fail = fail
        self.count = 0
        """How many such leases there are: while none, no path looks for one."""

    # ------------------------------------------------------------ joining

    def shared(self, now: float, req: Request, sessions: tuple[Session, ...], readers: int) -> bool:
        """Whether ``req`` joined another request reading its ticket (:meth:`join`).
        When it is the first of ``readers`` > 1, its group is made now: its read then
        does not carry the lease's done while siblings still on their way have not read."""
        lease = req.ticket.lease
        first = sessions[0].by_lease.get(lease)
        if first is not None and self.join(now, req, first, sessions, readers=readers):
            return True
        if readers > 1 and lease not in sessions[0].fanout:
            sessions[0].fanout[lease] = Fanout([req.request_id], expected=readers)
            self.count += 1
        return False

    def join(
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
            self.count += 1
        group.expected = max(group.expected, readers)
        rid = req.request_id
        if rid not in group.members:
            group.members.append(rid)
            group.joined += 1
            self.stats.fanout_joins += 1
        for session in sessions:
            copy_claim(first.parts[session.rank], req.parts[session.rank])
        if group.done_sent and not parked:
            # The lease's done went already: this reader rank is finished with it, and
            # that done's verdict cannot cover a read begun now.
            self.stats.fanout_late_reads += 1
            self._fail(now, req, FailReason.LEASE_LOST)
        return True

    def attach(self, session: Session, req: Request, first: str) -> bool:
        """``req``, parked on ``session``, is attached to the lease ``first`` reads already:
        whether it joined ``first``'s group (then it needs no claim of its own)."""
        group = session.fanout.get(req.ticket.lease)
        if group is not None and req.request_id in group.members:
            head = self._requests.get(first)
            if head is not None:
                copy_claim(head.parts[session.rank], req.parts[session.rank])
            return True  # joined on another of the engine's sessions already
        return self.join(-math.inf, req, first, (session,), parked=True)

    def leave(self, req: Request) -> None:
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
            self.count -= 1
            return
        heir = group.members[0]
        if index.get(lease) == rid:
            index[lease] = heir
        for rank in req.parts:
            beats = self._sessions[(engine, rank)].beats
            if beats.leases.owner(lease) == rid:
                beats.leases.add(lease, heir)  # the same id: count and digest stay

    # ------------------------------------------------------------ queries

    def siblings(self, group: Fanout, rid: str) -> list[Request]:
        """The other tracked requests reading ``group``'s lease."""
        requests = self._requests
        return [requests[m] for m in group.members if m != rid and m in requests]

    def group(self, session: Session, req: Request) -> Fanout | None:
        """``req``'s lease's group on ``session``'s engine, if ``req`` is in one."""
        group = session.fanout.get(req.ticket.lease)
        return group if group is not None and req.request_id in group.members else None

    def group_of(self, req: Request) -> Fanout | None:
        """``req``'s lease's group, if ``req`` is in one."""
        fanout = self._fanout.get(req.ticket.holder_engine)
        group = None if not fanout else fanout.get(req.ticket.lease)
        return group if group is not None and req.request_id in group.members else None

    def _others_need(
        self, group: Fanout, req: Request, rank: int, states: frozenset[ReadState]
    ) -> bool:
        """Whether a sibling of ``req`` is, towards holder ``rank``, in one of ``states``."""
        return any(
            not sib.failed and sib.parts[rank].state in states
            for sib in self.siblings(group, req.request_id)
        )

    def covered(self, group: Fanout, rank: int) -> Iterator[tuple[Request, Part]]:
        """The members (and their parts towards holder ``rank``) whose reads the lease's
        done covers: it left once their reads had landed; one held back still waits."""
        for rid in list(group.members):
            sib = self._requests.get(rid)
            part = None if sib is None else sib.parts.get(rank)
            if sib is not None and part is not None and part.done_frame:
                yield sib, part

    # ------------------------------------------------------------ the lease's done

    def done_of(self, now: float, group: Fanout, req: Request, rank: int, key: bytes) -> bytes:
        """The done ``req``'s read from holder ``rank`` carries, as ``req`` begins it: the
        lease's one done if this is its last read (every expected reader joined and no
        sibling is still to read), else none (``b""``: the done waits for the sibling)."""
        if group.joined >= group.expected and not self._others_need(group, req, rank, _STILL_READS):
            # Every sibling's read has landed (or it left): the lease's one done for
            # this holder rank rides this read, after the data as for a lone reader.
            frame = done_frame(req, key)
            self._done_goes(now, group, rank, frame)
            return frame
        return b""

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

    def settle(
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
        self.release_lease(now, session, landed[0][0].ticket.lease)
        self._holders.out.append(SendFrame(peer=session.peer, payload=frame))
        self._done_goes(now, group, rank, frame)

    def held_back_ran_out(self, now: float, req: Request, rank: int) -> None:
        """A done held back for a sibling waited ``ack_timeout``: it goes without it."""
        session = self._sessions[(req.ticket.holder_engine, rank)]
        group = self.group(session, req)
        if group is None:
            self._fail(now, req, FailReason.FENCED_NO_ACK)  # not reached: held back in a group
            return
        self.settle(now, group, session, rank, force=True)
        part = req.parts[rank]
        if not part.done_frame and part.ack_deadline <= now:
            # A sibling's read is under way: its landing settles the group (and holds the
            # done back again if one has still not begun).
            part.ack_deadline = math.inf
            self._dones.forget(req.request_id, rank)

    # ------------------------------------------------------------ letting go

    def let_go(self, now: float, group: Fanout, session: Session, req: Request, rank: int) -> bool:
        """``req`` no longer needs its lease from holder ``rank``: whether it was the last
        that did (the lease is released: an abort may follow). While a sibling still reads,
        or awaits the verdict of the lease's done (an abort overtaking that done would
        fence it), the lease stays and the done goes once the group settles."""
        if self._others_need(group, req, rank, _NEEDS_LEASE):
            self.settle(now, group, session, rank)
            return False
        self.release_lease(now, session, req.ticket.lease)
        return True

    def release_lease(self, now: float, session: Session, lease: int) -> None:
        """Stop heartbeating a group's lease (whichever of its readers the set names)."""
        owner = session.beats.leases.owner(lease)
        if owner is not None:
            release(self._requests, session, lease, owner, now=now, drift=self._drift)


def copy_claim(src: Part, dst: Part) -> None:
    """A sibling shares the lease's claim: what its acknowledgement proved is its too."""
    dst.lower_bound = max(dst.lower_bound, src.lower_bound)
    if src.claimed_seq < dst.claimed_seq:
        dst.claimed_seq = src.claimed_seq
        dst.state = read_next(dst.state, _ON_CLAIM_ACKED)
