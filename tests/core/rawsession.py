"""Open a holder session by hand, as a reader would, for tests that speak raw frames.

A session exists only for a Hello anchored on a ticket, and every
later frame is signed with the session key derived from that ticket's token.
"""

from __future__ import annotations

from kvproto import auth, wire
from kvproto.events import SendFrame
from kvproto.holder import Holder
from kvproto.ticket import LeaseTicket


def open_session(
    holder: Holder,
    ticket: LeaseTicket,
    peer: str,
    *,
    now: float = 0.0,
    engine: str = "D",
    rank: int = 0,
    tp: int = 1,
    incarnation: int = 1,
    attempt: int = 1,
    nonce: bytes = bytes(16),
) -> bytes | None:
    """Say Hello anchored on ``ticket``; the reader→holder key, or None if refused.

    Everything the holder sent is drained (the Welcome or the refusal).
    """
    proof = auth.hello_proof(
        ticket.token,
        reader_engine=engine,
        reader_rank=rank,
        reader_tp=tp,
        reader_incarnation=incarnation,
        holder_rank=holder.rank,
        lease=ticket.lease,
        attempt=attempt,
        nonce=nonce,
    )
    hello = wire.Hello(
        engine=engine,
        rank=rank,
        tp_size=tp,
        incarnation=incarnation,
        nonce=nonce,
        attempt=attempt,
        anchor=wire.Claim(lease=ticket.lease, proof=proof),
    )
    holder.handle_frame(now, peer, wire.encode(hello, holder.config.auth_secret))
    answers = [wire.decode(o.payload) for o in holder.drain() if isinstance(o, SendFrame)]
    welcome = next((m for m in answers if isinstance(m, wire.Welcome)), None)
    if welcome is None:
        return None
    up, _ = auth.session_keys(
        ticket.token,
        reader_engine=engine,
        reader_rank=rank,
        reader_incarnation=incarnation,
        holder_engine=holder.engine,
        holder_rank=holder.rank,
        holder_incarnation=holder.incarnation,
        nonce=nonce,
        server_nonce=welcome.server_nonce,
        secret=holder.config.auth_secret,
    )
    return up
