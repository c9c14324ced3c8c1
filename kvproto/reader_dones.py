"""The dones a reader sent and is waiting to hear acknowledged: when to re-send, when to give up.

A read's data counts only once the holder answers HELD to the done that rode
the read (spec/timing.md). From the read's landing until that verdict the
reader re-sends the done ``done_retries`` times, evenly spread, and fences the
read (``FENCED_NO_ACK``) once ``ack_timeout`` passes without one.
:class:`AwaitedDones` keeps those (request, holder rank) pairs and their two
times; :func:`verdict_of` says what a DoneAck's verdict is worth. It is apart
from the reader because it is a clock of its own (one per awaited part, beside
the sessions' heartbeat timers and the read deferrals) whose rules do not
depend on how requests are tracked. Like :mod:`kvproto.reader_requests`
nothing here fails anything or moves a state: the reader passes in what to do
with a fenced read and acts on :func:`kvproto.states.done_ack_action`.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Callable, Mapping

from kvproto import wire
from kvproto.config import LeaseConfig
from kvproto.events import SendFrame
from kvproto.reader_requests import Part, Request, SessionKey
from kvproto.reader_session import Session

_VERDICTS = {int(v): v for v in wire.DoneVerdict}
_HELD = wire.DoneVerdict.HELD
_REFUSED = wire.DoneVerdict.REFUSED


def done_frame(req: Request, key: bytes) -> bytes:
    """The done of ``req``'s read, signed with a session key: it frees the blocks (HELD)."""
    return wire.encode(wire.Done(claim=wire.Claim(lease=req.ticket.lease, proof=req.proof)), key)


def verdict_of(
    msg: wire.DoneAck, req: Request, prove: Callable[[bytes, int, int], bytes]
) -> wire.DoneVerdict | None:
    """The verdict ``msg`` gives ``req``'s done; None if it claims HELD without the lease's proof.

    ``prove``: the reader rank's :func:`~kvproto.auth.verdict_prover`. A verdict
    value this version does not know vouches for nothing: it reads as REFUSED.
    Only the lease's token vouches for a read, not even a session key (learnt
    from another, stolen, ticket) can make the reader trust one.
    """
    verdict = _VERDICTS.get(msg.verdict, _REFUSED)
    if verdict is _HELD:
        proof = prove(req.ticket.token, msg.lease, msg.verdict)
        if not hmac.compare_digest(proof, msg.proof):
            return None
    return verdict


class AwaitedDones:
    """The (request id, holder rank) pairs whose done's verdict has not come yet."""

    def __init__(
        self,
        requests: Mapping[str, Request],
        sessions: Mapping[SessionKey, Session],
        config: LeaseConfig,
    ) -> None:
        self.keys: set[tuple[str, int]] = set()
        """(request id, holder rank) of each done awaiting its verdict."""
        self._requests = requests
        self._sessions = sessions
        self._timeout = config.ack_timeout
        self._retries = config.done_retries
        self._step = config.ack_timeout / (config.done_retries + 1)

    def expect(self, now: float, req: Request, part: Part) -> None:
        """``part``'s read landed now, its done with it: await the verdict."""
        part.ack_deadline = now + self._timeout
        part.next_resend = now + self._step
        self.keys.add((req.request_id, part.rank))

    def hold_back(self, now: float, req: Request, part: Part) -> None:
        """``part``'s read landed, but its done waits for a sibling's read of the same lease
        (:class:`~kvproto.reader_session.Fanout`) that has not begun: at most ``ack_timeout``,
        after which the done goes without that sibling (a sibling that has not begun by
        then may not be able to: its blocks wait for this request's)."""
        part.ack_deadline = now + self._timeout
        part.next_resend = math.inf
        self.keys.add((req.request_id, part.rank))

    def forget(self, request_id: str, rank: int) -> None:
        """The part has its verdict, failed or finished: nothing to await any more."""
        self.keys.discard((request_id, rank))

    def of_session(self, session: Session) -> list[Request]:
        """The requests awaiting a verdict from ``session``'s holder rank."""
        found = []
        for rid, rank in self.keys:
            req = self._requests[rid]
            if rank == session.rank and req.ticket.holder_engine == session.engine:
                found.append(req)
        return found

    def next_due(self) -> float:
        """The earliest re-send or give-up time (inf: none)."""
        best = math.inf
        for rid, rank in self.keys:
            part = self._requests[rid].parts[rank]
            best = min(best, part.ack_deadline, part.next_resend)
        return best

    def serve(
        self,
        now: float,
        fence: Callable[[Request], None],
        send: Callable[[SendFrame], None],
        release: Callable[[Request, int], None],
    ) -> int:
        """``fence`` the reads whose verdict is late, ``send`` the due re-sends, ``release``
        the dones held back for a sibling that did not begin in time; how many re-sends."""
        resent = 0
        for rid, rank in list(self.keys):
            req = self._requests[rid]
            part = req.parts[rank]
            if part.ack_deadline <= now:
                if part.done_frame:
                    fence(req)
                else:
                    release(req, rank)
            elif part.next_resend <= now:
                session = self._sessions[(req.ticket.holder_engine, rank)]
                resent += 1
                part.resends += 1
                part.next_resend = now + self._step if part.resends < self._retries else math.inf
                # Re-signed with the current key: a re-key since the read began
                # would otherwise make every re-send fail its MAC.
                payload = done_frame(req, session.up) if session.up else part.done_frame
                send(SendFrame(peer=session.peer, payload=payload))
        return resent
