"""Whether the reader hears a frame from a holder: it decodes, it is genuine, it fits the state.

A frame reaches the reader's handlers only if it decodes, carries the proof
its kind needs (the session key's MAC; the anchor's token for a refused
Hello; the narrow rule of :meth:`~kvproto.reader_session.Session.heed_unsigned_no_session`
for an unsigned "no session"; a Welcome proves itself in
:meth:`~kvproto.reader_session.Session.welcome`), and arrives in a session
state where its kind means something. :func:`heard` makes that one decision
and says why a frame is dropped; it is apart from the reader because it is
pure filtering (nothing is failed, sent or counted here) and the reader's
part, acting on what is heard, reads clearer without it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from kvproto import wire
from kvproto.errors import RemoteProtocolError
from kvproto.reader_session import Session, Tracked
from kvproto.states import SessionState

_HELLO_SENT = SessionState.HELLO_SENT
_OPEN = SessionState.OPEN
_NO_SESSION = wire.RejectReason.NO_SESSION


class Unheard(enum.Enum):
    """Why a frame from a holder is dropped (each is counted in ``ReaderStats``)."""

    MALFORMED = "malformed"
    """It does not decode (``malformed``)."""
    BAD_MAC = "bad-mac"
    """It lacks the proof its kind needs (``bad_mac``)."""
    UNEXPECTED = "unexpected"
    """Genuine, but meaningless in the session's state (``unexpected_frames``)."""


Heard = wire.Welcome | wire.HeartbeatAck | wire.DoneAck | wire.Revoke | wire.Reject | wire.ArmAck
"""The frames the reader acts on."""


def heard(
    now: float, session: Session, data: bytes, requests: Mapping[str, Tracked]
) -> Heard | Unheard:
    """The message in ``data`` if the reader acts on it, else why it is dropped."""
    try:
        msg = wire.decode(data)
    except RemoteProtocolError:
        return Unheard.MALFORMED
    if isinstance(msg, wire.Welcome):
        return msg
    if isinstance(msg, wire.Reject) and session.state is _HELLO_SENT and msg.reason != _NO_SESSION:
        # The holder refused our Hello (too many sessions, TP layouts that do not
        # fit): without this the reader re-sent Hello forever and its requests
        # waited for a read that could never start. (NO_SESSION here only answers
        # a heartbeat sent before our Hello: we are saying Hello already.) Only a
        # refusal signed with our anchor's token counts: a forged one would fail
        # every request of the session.
        return msg if session.refusal_authentic(data) else Unheard.BAD_MAC
    if not session.authentic(data):
        if (
            isinstance(msg, wire.Reject)
            and msg.reason == _NO_SESSION
            and session.heed_unsigned_no_session(now, msg.seq, requests)
        ):
            return msg
        return Unheard.BAD_MAC
    if session.state is not _OPEN:
        return Unheard.UNEXPECTED
    if isinstance(msg, wire.HeartbeatAck | wire.DoneAck | wire.Revoke | wire.Reject | wire.ArmAck):
        return msg
    return Unheard.UNEXPECTED
