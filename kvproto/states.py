"""States and transition tables of the lease protocol.

Theory of operation
===================

A *holder* keeps KV blocks for a *reader*. In the seed's flow prefill (P)
holds and decode (D) reads; for bidirectional turn-2 blocks D holds and P
reads. Both directions run the same two state machines.

1. **Grant.** When prefill finishes, the holder grants a lease: a compact id,
   a 128-bit token, and an initial deadline ``now + kv_lease_duration``. The
   ticket travels to the reader with the request.

2. **Session.** Each reader rank opens one session per holder rank it reads
   from (Hello → Welcome). The Welcome carries the holder's lease timing, its
   incarnation, and a clock sample. The session is the unit of liveness: a
   heartbeat renews *every* lease the session holds, so heartbeats do not
   grow with the number of requests, and a lost peer ends all its leases at
   once.

3. **Claim and renew.** From the moment a request enters the reader's
   scheduler the reader claims its lease in the next heartbeat (proving the
   token) and heartbeats every ``interval``. A heartbeat arriving at ``t``
   moves the session deadline to ``max(old, t + extension)``; a lease is live
   while ``now < max(own deadline, deadline of any session holding it)`` and
   ``now < granted + max_hold``. Deadlines only ever move later. A reader
   starts a read only while its lower bound on the deadline is more than
   ``read_margin`` away; a bound that is close only because no heartbeat left
   during a long step is renewed by one early heartbeat and the decision put
   off (DEFERRED, once, for at most ``ack_timeout``) instead of declined.

4. **Done.** Each reader rank attaches a Done frame to its READ; it reaches
   the holder after the data left the holder's memory. The holder counts
   *distinct* ``(rank, incarnation)`` consumers and frees the blocks when the
   count reaches what the TP layouts agreed at Hello imply, never a number
   the reader sent. It answers each Done with HELD (the lease was live when
   the done arrived, so it was live for the whole read) or LATE/REFUSED; a
   reader uses loaded blocks only after HELD from every holder rank (fencing).

5. **End.** A lease ends exactly once: DONE, EXPIRED, ABORTED, REVOKED,
   MAX_HOLD or PEER_LOST. An ended lease is never revived: later claims are
   answered "lost", later dones LATE.

6. **Push.** In push mode the reader *writes* the holder's blocks (a writable
   lease: D holds its empty blocks, P writes). Claims renew as ever; right
   before writing, the writer sends an Arm and waits for its ArmAck (ARMING,
   ARMED). The lease's blocks are let go only once no armed writer can write
   any more (its done, its abort, its loss): a lease that ends earlier is
   quarantined (:data:`WRITE_TRANSITIONS`, spec/push-mode.md). The writer
   writes only armed (``begin-write``).

The tables below are the whole lease life cycle. A ``(state, input)`` pair
missing from a table is a bug in the caller and raises
:class:`~kvproto.errors.LocalProtocolError`; remote input that is not allowed
in a state has an explicit row (usually "stay, and answer late").
spec/state-tables.md and its diagrams are generated from these tables by
``python -m tests.docs.state_tables``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

from kvproto.errors import LocalProtocolError
from kvproto.wire import DoneVerdict


class LeaseState(enum.Enum):
    """Holder-side state of one lease."""

    GRANTED = "granted"
    """Granted, not yet claimed by any reader; lives on its own deadline."""
    HELD = "held"
    """Claimed by a reader engine; renewed through its sessions."""
    RELEASED = "released"
    """Every expected consumer finished reading (terminal)."""
    EXPIRED = "expired"
    """Lapsed without renewal, or hit max_hold (terminal)."""
    ABORTED = "aborted"
    """The reader gave the request up (terminal)."""
    REVOKED = "revoked"
    """Revoked locally, or every reader peer was lost (terminal)."""

    terminal: bool
    """The blocks were freed; nothing revives the lease. A plain attribute, set once
    below: the holder asks it on every claim and done."""

    # Identity hash, in C: Enum's own hashes the member's name in Python, and
    # every lease transition looks up a (state, input) pair (the claim hot path).
    __hash__ = object.__hash__


_LIVE = (LeaseState.GRANTED, LeaseState.HELD)
_TERMINAL = (LeaseState.RELEASED, LeaseState.EXPIRED, LeaseState.ABORTED, LeaseState.REVOKED)
for _state in LeaseState:
    _state.terminal = _state in _TERMINAL
del _state


class LeaseInput(enum.Enum):
    """Everything that can happen to a lease."""

    CLAIM = "claim"
    """A reader proved the token (heartbeat claim, or a done that claims)."""
    DONE = "done"
    """A consumer reported its read done, and more are expected (on an ended lease:
    any first done of a consumer, answered LATE)."""
    LAST_DONE = "last-done"
    """The last expected consumer reported its read done."""
    DUPLICATE_DONE = "duplicate-done"
    """A done again from the very session already counted for its rank."""
    FOREIGN_DONE = "foreign-done"
    """A done from a rank of another TP layout than the lease's first claimer's:
    not an expected consumer, so it never counts."""
    ABORT = "abort"
    """The owner reader aborted the request."""
    DEADLINE = "deadline"
    """The effective deadline (or max_hold) passed."""
    REVOKE = "revoke"
    """The holder's owner revoked the lease."""
    PEER_LOST = "peer-lost"
    """The transport lost the last reader peer holding the lease."""

    __hash__ = object.__hash__  # identity hash in C (see LeaseState)


_L = LeaseState
_LI = LeaseInput
# Remote inputs after the end are expected (late or duplicated frames): the
# lease stays ended and the sender is told. Local inputs (DEADLINE, REVOKE,
# PEER_LOST) on an ended lease are absent on purpose: the holder never
# produces them, so reaching one is a bug.
_LATE_INPUTS = (
    _LI.CLAIM,
    _LI.DONE,
    _LI.LAST_DONE,
    _LI.DUPLICATE_DONE,
    _LI.FOREIGN_DONE,
    _LI.ABORT,
)

LEASE_TRANSITIONS: dict[tuple[LeaseState, LeaseInput], LeaseState] = {
    (_L.GRANTED, _LI.CLAIM): _L.HELD,
    (_L.GRANTED, _LI.DONE): _L.HELD,  # a done claims too
    (_L.GRANTED, _LI.LAST_DONE): _L.RELEASED,
    # Only a counted done makes a duplicate, and counting one moves a lease out of
    # GRANTED: (GRANTED, DUPLICATE_DONE) is absent on purpose.
    (_L.GRANTED, _LI.FOREIGN_DONE): _L.GRANTED,
    (_L.GRANTED, _LI.ABORT): _L.ABORTED,
    (_L.GRANTED, _LI.DEADLINE): _L.EXPIRED,
    (_L.GRANTED, _LI.REVOKE): _L.REVOKED,
    (_L.GRANTED, _LI.PEER_LOST): _L.REVOKED,
    (_L.HELD, _LI.CLAIM): _L.HELD,
    (_L.HELD, _LI.DONE): _L.HELD,
    (_L.HELD, _LI.LAST_DONE): _L.RELEASED,
    (_L.HELD, _LI.DUPLICATE_DONE): _L.HELD,
    (_L.HELD, _LI.FOREIGN_DONE): _L.HELD,
    (_L.HELD, _LI.ABORT): _L.ABORTED,
    (_L.HELD, _LI.DEADLINE): _L.EXPIRED,
    (_L.HELD, _LI.REVOKE): _L.REVOKED,
    (_L.HELD, _LI.PEER_LOST): _L.REVOKED,
    **{(t, i): t for t in _TERMINAL for i in _LATE_INPUTS},
}

DONE_VERDICTS: dict[tuple[LeaseState, LeaseInput], DoneVerdict] = {
    **{(live, _LI.DONE): DoneVerdict.HELD for live in _LIVE},
    **{(live, _LI.LAST_DONE): DoneVerdict.HELD for live in _LIVE},
    **{(live, _LI.FOREIGN_DONE): DoneVerdict.REFUSED for live in _LIVE},
    (_L.HELD, _LI.DUPLICATE_DONE): DoneVerdict.HELD,
    **{(t, _LI.DONE): DoneVerdict.LATE for t in _TERMINAL},
    **{(t, _LI.LAST_DONE): DoneVerdict.LATE for t in _TERMINAL},
    **{(t, _LI.FOREIGN_DONE): DoneVerdict.REFUSED for t in _TERMINAL},
    # The answer its first done got, to the session already counted, once the blocks were
    # freed because every consumer was done; after any other end it was not vouched
    # for (the lease may have ended mid-read): LATE.
    (_L.RELEASED, _LI.DUPLICATE_DONE): DoneVerdict.HELD,
    **{(t, _LI.DUPLICATE_DONE): DoneVerdict.LATE for t in _TERMINAL if t is not _L.RELEASED},
}
"""The holder's answer to a done, for each done input a lease can take (the
DoneAck verdict); the state it moves to is in :data:`LEASE_TRANSITIONS`."""


_RowState = TypeVar("_RowState", bound=enum.Enum)
_RowInput = TypeVar("_RowInput", bound=enum.Enum)
_RowValue = TypeVar("_RowValue")


def _row(
    table: Mapping[tuple[_RowState, _RowInput], _RowValue],
    state: _RowState,
    event: _RowInput,
    what: str,
) -> _RowValue:
    """``table``'s row for the pair; a missing pair is a LocalProtocolError."""
    try:
        return table[(state, event)]
    except KeyError:
        raise LocalProtocolError(
            f"{what} in state {state.value} cannot take {event.value}"
        ) from None


def lease_next(state: LeaseState, event: LeaseInput) -> LeaseState:
    """Look the transition up; a missing pair is a LocalProtocolError."""
    new = LEASE_TRANSITIONS.get((state, event))  # inline: once per claim, done and end
    return _row(LEASE_TRANSITIONS, state, event, "lease") if new is None else new


def done_verdict(state: LeaseState, event: LeaseInput) -> DoneVerdict:
    """The verdict a done input earns in ``state``; a missing pair is a LocalProtocolError."""
    return _row(DONE_VERDICTS, state, event, "lease verdict")


class PeerSessionState(enum.Enum):
    """Holder-side state of the session a transport peer may have with it."""

    ABSENT = "absent"
    """No session for this peer (never opened, lost, evicted, or refused)."""
    OPEN = "open"
    """Keyed; its heartbeats renew the leases it holds."""


class PeerSessionInput(enum.Enum):
    """What can happen to a holder's session with one peer (Hellos, classified, and loss)."""

    FIRST = "first"
    """A Hello with a valid anchor from a peer with no session: open one."""
    DUPLICATE = "duplicate"
    """The same Hello again (same nonce): answered as the first, same server nonce."""
    REKEY = "rekey"
    """A newer Hello of the same reader (attempt ahead): new keys, same leases."""
    REPLAYED = "replayed"
    """An older Hello of the same reader: ignored, counted."""
    IMPOSTOR = "impostor"
    """The session's incarnation under another engine, rank or TP size: ignored, counted."""
    RESTARTED = "restarted"
    """A new reader incarnation under the same peer name: the old reader died, its
    session is lost (its leases end), and the Hello is then a FIRST."""
    LOST = "lost"
    """The transport lost the peer, or the holder evicted the idle session."""


_P = PeerSessionState
_H = PeerSessionInput
PEER_SESSION_TRANSITIONS: dict[tuple[PeerSessionState, PeerSessionInput], PeerSessionState] = {
    (_P.ABSENT, _H.FIRST): _P.OPEN,
    (_P.ABSENT, _H.LOST): _P.ABSENT,
    (_P.OPEN, _H.DUPLICATE): _P.OPEN,
    (_P.OPEN, _H.REKEY): _P.OPEN,
    (_P.OPEN, _H.REPLAYED): _P.OPEN,
    (_P.OPEN, _H.IMPOSTOR): _P.OPEN,
    (_P.OPEN, _H.RESTARTED): _P.ABSENT,
    (_P.OPEN, _H.LOST): _P.ABSENT,
}
"""A Hello is classified against the peer's session before its anchor is
checked; a refused Hello (no valid anchor, a rank that does not read from this
holder, the session limit) moves nothing. Only an absent session can take a
FIRST Hello, so RESTARTED ends the old one and the Hello is then a FIRST."""


def peer_session_next(state: PeerSessionState, event: PeerSessionInput) -> PeerSessionState:
    """Look the transition up; a missing pair is a LocalProtocolError."""
    return _row(PEER_SESSION_TRANSITIONS, state, event, "peer session")


class ReadState(enum.Enum):
    """Reader-side state of one request towards one holder rank."""

    TRACKED = "tracked"
    """In the reader's scheduler; heartbeating, claim not yet acknowledged."""
    CLAIMED = "claimed"
    """The holder acknowledged the claim."""
    DEFERRED = "deferred"
    """begin_read found the deadline bound too close only for lack of a recent
    acknowledgement: a heartbeat went out early, the decision waits for its ack
    (at most once per request; ``ack_timeout`` at most)."""
    ARMING = "arming"
    """Push mode: the claim was acknowledged and an Arm asks the holder to fence the
    write; waiting for its ArmAck."""
    ARMED = "armed"
    """Push mode: the holder armed the write fence for this writer: it may write."""
    READING = "reading"
    """The read (or write) was issued; the done frame travels with it."""
    AWAITING_ACK = "awaiting-ack"
    """The read finished locally; waiting for the holder's verdict."""
    CONFIRMED = "confirmed"
    """HELD: the data is valid (terminal)."""
    FAILED = "failed"
    """Lost, revoked, fenced, declined or failed: recompute (terminal)."""
    FINISHED = "finished"
    """The request left the reader before any read (abort); lease aborted (terminal)."""

    __hash__ = object.__hash__  # identity hash in C (see LeaseState)


class ReadInput(enum.Enum):
    """Everything that can happen to a request on the reader."""

    CLAIM_ACKED = "claim-acked"
    """A heartbeat acknowledgement listed the lease as held."""
    DEFER = "defer"
    """begin_read renewed the lease early instead of declining (once per request)."""
    BEGIN_READ = "begin-read"
    """The binding is starting the read."""
    ARM = "arm"
    """Push mode: an Arm went to the holder (``begin_write`` on a claimed part)."""
    ARM_ACKED = "arm-acked"
    """Push mode: the holder answered the Arm: armed."""
    BEGIN_WRITE = "begin-write"
    """The binding is starting the write of a ``writes=True`` request (push mode): only
    once the holder armed the writer (spec/push-mode.md, W2)."""
    READ_DONE = "read-done"
    """The transport reported the read complete."""
    ACK_HELD = "ack-held"
    """The holder answered HELD."""
    FAIL = "fail"
    """Lost, revoked, refused, late, no ack, declined or transfer failure."""
    FINISH = "finish"
    """The request finished or was aborted in the reader's scheduler."""

    __hash__ = object.__hash__  # identity hash in C (see LeaseState)


_R = ReadState
_I = ReadInput
READ_TRANSITIONS: dict[tuple[ReadState, ReadInput], ReadState] = {
    (_R.TRACKED, _I.CLAIM_ACKED): _R.CLAIMED,
    (_R.TRACKED, _I.DEFER): _R.DEFERRED,
    (_R.TRACKED, _I.BEGIN_READ): _R.READING,
    (_R.TRACKED, _I.FAIL): _R.FAILED,
    (_R.TRACKED, _I.FINISH): _R.FINISHED,
    (_R.CLAIMED, _I.CLAIM_ACKED): _R.CLAIMED,
    (_R.CLAIMED, _I.DEFER): _R.DEFERRED,
    (_R.CLAIMED, _I.BEGIN_READ): _R.READING,
    (_R.CLAIMED, _I.FAIL): _R.FAILED,
    (_R.CLAIMED, _I.FINISH): _R.FINISHED,
    # Push mode: a claimed part is armed (Arm, then its ArmAck) before it writes, and
    # writes only armed: no BEGIN_WRITE row from TRACKED, CLAIMED or ARMING.
    (_R.CLAIMED, _I.ARM): _R.ARMING,
    (_R.ARMING, _I.ARM): _R.ARMING,  # the Arm re-sent
    (_R.ARMING, _I.CLAIM_ACKED): _R.ARMING,
    (_R.ARMING, _I.ARM_ACKED): _R.ARMED,
    (_R.ARMING, _I.FAIL): _R.FAILED,
    (_R.ARMING, _I.FINISH): _R.FINISHED,
    (_R.ARMED, _I.CLAIM_ACKED): _R.ARMED,
    (_R.ARMED, _I.ARM_ACKED): _R.ARMED,
    (_R.ARMED, _I.BEGIN_WRITE): _R.READING,
    (_R.ARMED, _I.FAIL): _R.FAILED,
    (_R.ARMED, _I.FINISH): _R.FINISHED,
    # No (DEFERRED, DEFER) row: one deferral per request, so a read that the early
    # heartbeat did not save is declined, never deferred again (no livelock).
    (_R.DEFERRED, _I.CLAIM_ACKED): _R.DEFERRED,
    (_R.DEFERRED, _I.BEGIN_READ): _R.READING,
    (_R.DEFERRED, _I.FAIL): _R.FAILED,
    (_R.DEFERRED, _I.FINISH): _R.FINISHED,
    (_R.READING, _I.CLAIM_ACKED): _R.READING,
    (_R.READING, _I.READ_DONE): _R.AWAITING_ACK,
    (_R.READING, _I.ACK_HELD): _R.READING,
    (_R.READING, _I.ARM_ACKED): _R.READING,  # a duplicated ArmAck
    (_R.READING, _I.FAIL): _R.FAILED,
    (_R.READING, _I.FINISH): _R.FINISHED,
    (_R.AWAITING_ACK, _I.CLAIM_ACKED): _R.AWAITING_ACK,
    (_R.AWAITING_ACK, _I.ACK_HELD): _R.CONFIRMED,
    (_R.AWAITING_ACK, _I.FAIL): _R.FAILED,
    (_R.AWAITING_ACK, _I.FINISH): _R.FINISHED,
    (_R.CONFIRMED, _I.CLAIM_ACKED): _R.CONFIRMED,
    (_R.CONFIRMED, _I.ACK_HELD): _R.CONFIRMED,
    (_R.CONFIRMED, _I.FINISH): _R.CONFIRMED,
    (_R.CONFIRMED, _I.FAIL): _R.FAILED,
    # A request can fail between the caller's checks and begin_read (a race): it
    # stays failed and the reader declines it.
    (_R.FAILED, _I.BEGIN_READ): _R.FAILED,
    (_R.FAILED, _I.BEGIN_WRITE): _R.FAILED,
    (_R.FAILED, _I.CLAIM_ACKED): _R.FAILED,
    (_R.FAILED, _I.READ_DONE): _R.FAILED,
    (_R.FAILED, _I.ACK_HELD): _R.FAILED,
    (_R.FAILED, _I.FAIL): _R.FAILED,
    (_R.FAILED, _I.FINISH): _R.FAILED,
    (_R.FAILED, _I.ARM_ACKED): _R.FAILED,
    (_R.FINISHED, _I.CLAIM_ACKED): _R.FINISHED,
    (_R.FINISHED, _I.READ_DONE): _R.FINISHED,
    (_R.FINISHED, _I.ACK_HELD): _R.FINISHED,
    (_R.FINISHED, _I.FAIL): _R.FINISHED,
    (_R.FINISHED, _I.FINISH): _R.FINISHED,
    (_R.FINISHED, _I.ARM_ACKED): _R.FINISHED,
}
"""A HELD verdict can overtake the local read-complete report (the done rides
the transfer, the verdict a notification), hence ``(READING, ACK_HELD)``: it
is remembered and applied at READ_DONE. A read can fail (lost, revoked, no
ack) while its transfer is still in flight, hence ``(FAILED, READ_DONE)``: the
late completion changes nothing. The terminal states take every input but the
local decisions (DEFER, BEGIN_READ) and stay: a request that failed or finished
is not read -- except ``(FAILED, BEGIN_READ)``: a request can fail between the
caller's checks and its begin_read, which declines it. DEFERRED has no DEFER
row: a request is deferred at most once. Pairs still absent (a DEFER or
BEGIN_READ after the read began or ended, a READ_DONE before any read) are
calls the reader never makes. Push mode: ARM is taken from CLAIMED (and ARMING, a
re-send), BEGIN_WRITE only from ARMED, and from FAILED for the same race as
BEGIN_READ: a write never starts before the holder armed its writer, and never
twice. An ArmAck that comes late (AWAITING_ACK, CONFIRMED) is dropped before the
table; one that meets READING, FAILED or FINISHED stays."""


def read_next(state: ReadState, event: ReadInput) -> ReadState:
    """Look the transition up; a missing pair is a LocalProtocolError."""
    try:
        return READ_TRANSITIONS[(state, event)]
    except KeyError:
        raise LocalProtocolError(
            f"request in state {state.value} cannot take {event.value}"
        ) from None


class DoneAckAction(enum.Enum):
    """What the reader makes of a holder's verdict on one part's done."""

    REMEMBER_HELD = "remember-held"
    """HELD overtook the local read-complete report: applied at READ_DONE."""
    CONFIRM = "confirm"
    """HELD for a finished read: the part is confirmed (ACK_HELD)."""
    FENCE = "fence"
    """LATE or REFUSED for a read that began: the request fails and recomputes."""
    IGNORE = "ignore"
    """A verdict for no read in flight (duplicated, or a bad peer): counted, dropped."""

    __hash__ = object.__hash__  # identity hash in C (see LeaseState)


_A = DoneAckAction
_V = DoneVerdict
_STARTED = (_R.READING, _R.AWAITING_ACK)
DONE_ACK_ACTIONS: dict[tuple[ReadState, DoneVerdict], DoneAckAction] = {
    (_R.READING, _V.HELD): _A.REMEMBER_HELD,
    (_R.AWAITING_ACK, _V.HELD): _A.CONFIRM,
    **{(s, v): _A.FENCE for s in _STARTED for v in (_V.LATE, _V.REFUSED)},
    **{(s, v): _A.IGNORE for s in ReadState if s not in _STARTED for v in DoneVerdict},
}
"""The reader's answer to a DoneAck, by the part's state and the verdict; the state a
HELD moves the part to is in :data:`READ_TRANSITIONS` (``ACK_HELD``)."""


def done_ack_action(state: ReadState, verdict: DoneVerdict) -> DoneAckAction:
    """The row for a verdict in ``state``; a missing pair is a LocalProtocolError."""
    return _row(DONE_ACK_ACTIONS, state, verdict, "read verdict")


class SessionState(enum.Enum):
    """Reader-side state of its session with one holder rank."""

    IDLE = "idle"
    """Nothing asked for it yet."""
    CONNECTING = "connecting"
    """The binding was asked to make the holder reachable."""
    HELLO_SENT = "hello-sent"
    """Hello sent, waiting for Welcome."""
    OPEN = "open"
    """Welcome received; heartbeats flow."""
    BROKEN = "broken"
    """Peer lost or connect failed; its requests were failed."""

    __hash__ = object.__hash__  # identity hash in C (see LeaseState)


class SessionInput(enum.Enum):
    """Everything that can happen to a reader session."""

    NEED = "need"
    """A request needs this holder rank."""
    CONNECTED = "connected"
    """The binding reports the holder reachable."""
    WELCOME = "welcome"
    """The holder's Welcome arrived."""
    REJECTED = "rejected"
    """The holder no longer knows the session (answer: Hello again)."""
    LOST = "lost"
    """The transport lost the peer, or connecting failed."""

    __hash__ = object.__hash__  # identity hash in C (see LeaseState)


_S = SessionState
_SI = SessionInput
SESSION_TRANSITIONS: dict[tuple[SessionState, SessionInput], SessionState] = {
    (_S.IDLE, _SI.NEED): _S.CONNECTING,
    (_S.IDLE, _SI.LOST): _S.IDLE,
    (_S.CONNECTING, _SI.NEED): _S.CONNECTING,
    (_S.CONNECTING, _SI.CONNECTED): _S.HELLO_SENT,
    (_S.CONNECTING, _SI.LOST): _S.BROKEN,
    (_S.HELLO_SENT, _SI.NEED): _S.HELLO_SENT,
    (_S.HELLO_SENT, _SI.CONNECTED): _S.HELLO_SENT,
    (_S.HELLO_SENT, _SI.WELCOME): _S.OPEN,
    (_S.HELLO_SENT, _SI.REJECTED): _S.HELLO_SENT,
    (_S.HELLO_SENT, _SI.LOST): _S.BROKEN,
    (_S.OPEN, _SI.NEED): _S.OPEN,
    (_S.OPEN, _SI.CONNECTED): _S.OPEN,
    (_S.OPEN, _SI.WELCOME): _S.OPEN,
    (_S.OPEN, _SI.REJECTED): _S.HELLO_SENT,
    (_S.OPEN, _SI.LOST): _S.BROKEN,
    (_S.BROKEN, _SI.NEED): _S.CONNECTING,
    (_S.BROKEN, _SI.CONNECTED): _S.BROKEN,
    (_S.BROKEN, _SI.LOST): _S.BROKEN,
}
"""``(BROKEN, CONNECTED)``: the binding's connect finished after the session
broke (peer lost, refused); the reader counts it and stays broken -- the next
request asks for a fresh connection. WELCOME and REJECTED reach the table only
in HELLO_SENT and OPEN (other frames are dropped before it); CONNECTED for a
session never asked for (IDLE) is the binding's bug."""


def session_next(state: SessionState, event: SessionInput) -> SessionState:
    """Look the transition up; a missing pair is a LocalProtocolError."""
    try:
        return SESSION_TRANSITIONS[(state, event)]
    except KeyError:
        raise LocalProtocolError(
            f"session in state {state.value} cannot take {event.value}"
        ) from None


class WriteState(enum.Enum):
    """Holder-side state of a writable lease's blocks (push mode: spec/push-mode.md §3)."""

    OPEN = "open"
    """Live, no writer armed: the blocks could be freed at once."""
    ARMED = "armed"
    """Live, and a writer session may write into the blocks."""
    QUARANTINED = "quarantined"
    """Ended while a writer may still write: neither used nor reused (``WriteFenced``)."""
    SETTLED = "settled"
    """Ended, and no write can land any more: ``FreeBlocks`` emitted (terminal)."""

    __hash__ = object.__hash__  # identity hash in C (see LeaseState)


class WriteInput(enum.Enum):
    """What can happen to a writable lease's blocks."""

    ARM = "arm"
    """A writer session that holds the live lease sent an Arm: it may write from now on."""
    DISARM = "disarm"
    """An armed session can write no more (its done or abort arrived, or its peer was
    lost), and another is still armed."""
    LAST_DISARM = "last-disarm"
    """The last armed session can write no more."""
    END = "end"
    """The lease ended, for any reason (DONE included)."""

    __hash__ = object.__hash__  # identity hash in C (see LeaseState)


_W = WriteState
_WI = WriteInput
WRITE_TRANSITIONS: dict[tuple[WriteState, WriteInput], WriteState] = {
    (_W.OPEN, _WI.ARM): _W.ARMED,
    (_W.OPEN, _WI.END): _W.SETTLED,
    (_W.ARMED, _WI.ARM): _W.ARMED,
    (_W.ARMED, _WI.DISARM): _W.ARMED,
    (_W.ARMED, _WI.LAST_DISARM): _W.OPEN,
    (_W.ARMED, _WI.END): _W.QUARANTINED,
    (_W.QUARANTINED, _WI.DISARM): _W.QUARANTINED,
    (_W.QUARANTINED, _WI.LAST_DISARM): _W.SETTLED,
}
"""Entering QUARANTINED emits ``WriteFenced``, entering SETTLED ``FreeBlocks``. Absent on
purpose: ARM after the end (a claim of an ended lease is answered lost, it arms nothing),
a DISARM with nobody armed (only armed sessions are disarmed), a second END (a lease ends
once), and anything in SETTLED (the lease is out of the write fence: a late done or abort
of it is the lease table's business alone)."""


def write_next(state: WriteState, event: WriteInput) -> WriteState:
    """Look the transition up; a missing pair is a LocalProtocolError."""
    return _row(WRITE_TRANSITIONS, state, event, "writable lease")
