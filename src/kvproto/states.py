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

The tables below are the whole lease life cycle. A ``(state, input)`` pair
missing from a table is a bug in the caller and raises
:class:`~kvproto.errors.LocalProtocolError`; remote input that is not allowed
in a state has an explicit row (usually "stay, and answer late").
spec/state-tables.md and its diagrams are generated from these tables by
``python -m kvproto.diagrams``.
"""

from __future__ import annotations

import enum

from kvproto.errors import LocalProtocolError


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

    @property
    def terminal(self) -> bool:
        """The blocks were freed; nothing revives the lease."""
        return self in _TERMINAL


_TERMINAL = frozenset(
    {LeaseState.RELEASED, LeaseState.EXPIRED, LeaseState.ABORTED, LeaseState.REVOKED}
)


class LeaseInput(enum.Enum):
    """Everything that can happen to a lease."""

    CLAIM = "claim"
    """A reader proved the token (heartbeat claim, or a done that claims)."""
    DONE = "done"
    """A consumer reported its read done, and more are expected."""
    LAST_DONE = "last-done"
    """The last expected consumer reported its read done."""
    ABORT = "abort"
    """The owner reader aborted the request."""
    DEADLINE = "deadline"
    """The effective deadline (or max_hold) passed."""
    REVOKE = "revoke"
    """The holder's owner revoked the lease."""
    PEER_LOST = "peer-lost"
    """The transport lost the last reader peer holding the lease."""


_LIVE_ROWS: dict[LeaseInput, LeaseState] = {
    LeaseInput.CLAIM: LeaseState.HELD,
    LeaseInput.DONE: LeaseState.HELD,
    LeaseInput.LAST_DONE: LeaseState.RELEASED,
    LeaseInput.ABORT: LeaseState.ABORTED,
    LeaseInput.DEADLINE: LeaseState.EXPIRED,
    LeaseInput.REVOKE: LeaseState.REVOKED,
    LeaseInput.PEER_LOST: LeaseState.REVOKED,
}

# Remote inputs after the end are expected (late or duplicated frames): the
# lease stays ended and the sender is told. Local inputs (DEADLINE, REVOKE,
# PEER_LOST) on an ended lease are absent on purpose: the holder never
# produces them, so reaching one is a bug.
_LATE_ROWS: dict[LeaseInput, None] = {
    LeaseInput.CLAIM: None,
    LeaseInput.DONE: None,
    LeaseInput.LAST_DONE: None,
    LeaseInput.ABORT: None,
}

LEASE_TRANSITIONS: dict[tuple[LeaseState, LeaseInput], LeaseState] = {
    **{(LeaseState.GRANTED, i): s for i, s in _LIVE_ROWS.items()},
    **{(LeaseState.HELD, i): s for i, s in _LIVE_ROWS.items()},
    **{(t, i): t for t in _TERMINAL for i in _LATE_ROWS},
}


def lease_next(state: LeaseState, event: LeaseInput) -> LeaseState:
    """Look the transition up; a missing pair is a LocalProtocolError."""
    try:
        return LEASE_TRANSITIONS[(state, event)]
    except KeyError:
        raise LocalProtocolError(
            f"lease in state {state.value} cannot take {event.value}"
        ) from None


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
    READING = "reading"
    """The read was issued; the done frame travels with it."""
    AWAITING_ACK = "awaiting-ack"
    """The read finished locally; waiting for the holder's verdict."""
    CONFIRMED = "confirmed"
    """HELD: the data is valid (terminal)."""
    FAILED = "failed"
    """Lost, revoked, fenced, declined or failed: recompute (terminal)."""
    FINISHED = "finished"
    """The request left the reader before any read (abort); lease aborted (terminal)."""


class ReadInput(enum.Enum):
    """Everything that can happen to a request on the reader."""

    CLAIM_ACKED = "claim-acked"
    """A heartbeat acknowledgement listed the lease as held."""
    DEFER = "defer"
    """begin_read renewed the lease early instead of declining (once per request)."""
    BEGIN_READ = "begin-read"
    """The binding is starting the read."""
    READ_DONE = "read-done"
    """The transport reported the read complete."""
    ACK_HELD = "ack-held"
    """The holder answered HELD."""
    FAIL = "fail"
    """Lost, revoked, refused, late, no ack, declined or transfer failure."""
    FINISH = "finish"
    """The request finished or was aborted in the reader's scheduler."""


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
    # No (DEFERRED, DEFER) row: one deferral per request, so a read that the early
    # heartbeat did not save is declined, never deferred again (no livelock).
    (_R.DEFERRED, _I.CLAIM_ACKED): _R.DEFERRED,
    (_R.DEFERRED, _I.BEGIN_READ): _R.READING,
    (_R.DEFERRED, _I.FAIL): _R.FAILED,
    (_R.DEFERRED, _I.FINISH): _R.FINISHED,
    (_R.READING, _I.CLAIM_ACKED): _R.READING,
    (_R.READING, _I.READ_DONE): _R.AWAITING_ACK,
    (_R.READING, _I.ACK_HELD): _R.READING,
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
    (_R.FAILED, _I.CLAIM_ACKED): _R.FAILED,
    (_R.FAILED, _I.ACK_HELD): _R.FAILED,
    (_R.FAILED, _I.FAIL): _R.FAILED,
    (_R.FAILED, _I.FINISH): _R.FAILED,
}
"""A HELD verdict can overtake the local read-complete report (the done rides
the transfer, the verdict a notification), hence ``(READING, ACK_HELD)``: it
is remembered and applied at READ_DONE. DEFERRED has no DEFER row: a request is
deferred at most once."""


def read_next(state: ReadState, event: ReadInput) -> ReadState:
    """Look the transition up; a missing pair is a LocalProtocolError."""
    try:
        return READ_TRANSITIONS[(state, event)]
    except KeyError:
        raise LocalProtocolError(
            f"request in state {state.value} cannot take {event.value}"
        ) from None


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
    (_S.BROKEN, _SI.LOST): _S.BROKEN,
}


def session_next(state: SessionState, event: SessionInput) -> SessionState:
    """Look the transition up; a missing pair is a LocalProtocolError."""
    try:
        return SESSION_TRANSITIONS[(state, event)]
    except KeyError:
        raise LocalProtocolError(
            f"session in state {state.value} cannot take {event.value}"
        ) from None
