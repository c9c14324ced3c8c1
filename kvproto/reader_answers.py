"""The holder's answers to a reader: heartbeat acknowledgements, done verdicts, revokes.

A HeartbeatAck proves a lower bound on each claimed lease's deadline (and a clock
sample), names the leases the holder lost, and tells whether the heartbeat sets
still agree; a DoneAck's verdict confirms a read (HELD) or fences it; a Revoke ends
leases. :class:`Answers` applies them to the requests: what a verdict does to one
read is :func:`kvproto.states.done_ack_action`'s to say, and a lease several requests
read (:mod:`kvproto.reader_fanout`) is answered for all of them at once.

It is apart from the reader because it is the path of frames *in*, keyed by
lease; the requests stay the reader's. What changes a request's life is handed in
as the ``fail`` callback, as in :class:`~kvproto.reader_peers.HolderSessions`.
"""

from __future__ import annotations

from collections.abc import Callable

from kvproto import bounds, wire
from kvproto.clock import SkewSample
from kvproto.events import FailReason, ReadConfirmed
from kvproto.reader_dones import AwaitedDones, verdict_of
from kvproto.reader_fanout import Fanouts, copy_claim
from kvproto.reader_peers import HolderSessions
from kvproto.reader_requests import Deferrals, Part, Request, find_part
from kvproto.reader_session import Session
from kvproto.states import DoneAckAction, ReadInput, done_ack_action, read_next
from kvproto.stats import ReaderStats

_ON_ACK_HELD = ReadInput.ACK_HELD  # module constants: see kvproto.reader
_ON_CLAIM_ACKED = ReadInput.CLAIM_ACKED
_REMEMBER_HELD = DoneAckAction.REMEMBER_HELD
_CONFIRM = DoneAckAction.CONFIRM
_FENCE = DoneAckAction.FENCE


class Answers:
    """What the holder's answers do to a reader's requests. See the module docstring."""

    def __init__(
        self,
        requests: dict[str, Request],
        holders: HolderSessions,
        fanouts: Fanouts,
        *,
        stats: ReaderStats,
        drift: float,
        deferrals: Deferrals,
        dones: AwaitedDones,
        prove_verdict: Callable[[bytes, int, int], bytes],
        fail: Callable[[float, Request, FailReason], None],
    ) -> None:
        self._requests = requests
        self._holders = holders
        """Their ``out`` is the reader's output list (a new one after each drain)."""
        self._fanouts = fanouts
        self.stats = stats
        self._drift = drift
        self._deferrals = deferrals
        self._dones = dones
        self._prove_verdict = prove_verdict
        """The reader rank's :func:`~kvproto.auth.verdict_prover`."""
        self._fail = fail

    def on_ack(self, now: float, session: Session, ack: wire.HeartbeatAck) -> None:
        """A HeartbeatAck: the claims it answers, the leases it lost, whether sets agree."""
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
            group = session.fanout.get(lease) if self._fanouts.count else None
            if group is not None:
                for sibling in self._fanouts.siblings(group, req.request_id):
                    copy_claim(part, sibling.parts[session.rank])
        for lease in ack.lost:
            beats.pending_claims.pop(lease, None)
            self.lease_failed(now, session, lease, FailReason.LEASE_LOST)
        if beats.compared(ack.seq, sent, resync=ack.resync):
            self._deferrals.resync(now, session, ack.seq, self._holders.beat)

    def on_done_ack(self, now: float, session: Session, msg: wire.DoneAck) -> None:
        """A DoneAck: its verdict, if genuine, is the read's (or each covered sibling's)."""
        req, part = find_part(self._requests, session, msg.lease)
        if req is None or part is None:
            self.stats.unexpected_frames += 1
            return
        verdict = verdict_of(msg, req, self._prove_verdict)
        if verdict is None:
            self.stats.bad_mac += 1
            return
        group = session.fanout.get(msg.lease) if self._fanouts.count else None
        if group is not None and req.request_id in group.members:
            acted = False
            for sib, sib_part in self._fanouts.covered(group, session.rank):
                if self._apply_verdict(now, sib, sib_part, verdict):
                    acted = True
            if not acted:
                self.stats.unexpected_frames += 1
            return
        if not self._apply_verdict(now, req, part, verdict):
            self.stats.unexpected_frames += 1

    def _apply_verdict(
        self, now: float, req: Request, part: Part, verdict: wire.DoneVerdict
    ) -> bool:
        """What the DoneAck table says one part does with ``verdict``; False when the
        table gives it nothing to do (the caller counts or skips that)."""
        action = done_ack_action(part.state, verdict)
        if action is _REMEMBER_HELD:
            part.state = read_next(part.state, _ON_ACK_HELD)
            part.early_held = True
        elif action is _CONFIRM:
            self.held(req, part)
        elif action is _FENCE:
            self.stats.fenced += 1
            late = verdict is wire.DoneVerdict.LATE
            self._fail(now, req, FailReason.FENCED_LATE if late else FailReason.REFUSED)
        else:
            return False
        return True

    def held(self, req: Request, part: Part) -> None:
        """The holder answered HELD to ``part``'s done: the read is confirmed once all are."""
        part.state = read_next(part.state, _ON_ACK_HELD)
        self._dones.forget(req.request_id, part.rank)
        if req.confirmed:
            self.stats.reads_confirmed += 1
            self._holders.out.append(ReadConfirmed(request_id=req.request_id))

    def lease_failed(self, now: float, session: Session, lease: int, reason: FailReason) -> None:
        """The holder lost or revoked ``lease``: every request reading it fails."""
        req, part = find_part(self._requests, session, lease)
        if req is None or part is None:
            return
        group = session.fanout.get(lease) if self._fanouts.count else None
        if group is not None and req.request_id in group.members:
            for sibling in self._fanouts.siblings(group, req.request_id):
                self._fail(now, sibling, reason)
        self._fail(now, req, reason)
