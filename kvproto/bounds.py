"""Deadline maths of the reader: what it can prove about a holder's lease deadline.

Pure functions of what the reader recorded (heartbeats sent and answered,
the ticket, the session's clock-offset estimate); no state, no clock read.
Kept apart from :class:`~kvproto.reader.Reader` the way aioquic keeps its
loss and RTT maths in ``recovery.py``: the reader decides *what to do*, this
module says *what is known*.

Two directions, both conservative for the decision they feed:

* a *lower* bound on the holder's deadline (:func:`ticket_bound`,
  :func:`in_sync_bound`, :func:`hard_bound`) gates a read: reading is safe
  only while the lease surely lives;
* an *upper* bound (:func:`lapsed`, :func:`surely_lapsed_at`) says the lease
  has surely ended, so the request can be given up without asking.

``drift`` is the relative clock-rate error allowed between the two hosts
(``max_drift_ppm * 1e-6``): durations the holder measures are stretched or
shrunk by it, whichever is the safe side.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

from kvproto.clock import SkewEstimator
from kvproto.config import LeaseParams
from kvproto.ticket import LeaseTicket


class SentBeat(Protocol):
    """What the bounds need of one sent heartbeat (:class:`kvproto.beats.Inflight`)."""

    @property
    def sent(self) -> float:
        """When it left (local clock)."""

    @property
    def acked_at(self) -> float | None:
        """When its acknowledgement arrived (local clock); None while unanswered."""


def read_margin(configured: float, ticket: LeaseTicket) -> float:
    """The configured margin, but never more than half the holder's extension.

    A reader configured for 30 s leases would otherwise decline every read
    from a holder that advertises 6 s leases (extension 4 s < margin 5 s).
    """
    return min(configured, ticket.params.extension / 2)


def ticket_bound(skew: SkewEstimator, ticket: LeaseTicket, now: float) -> float:
    """The ticket's deadline in local time, conservatively; -inf without a clock sample."""
    if not skew.known:
        return -math.inf
    return skew.peer_deadline_to_local(ticket.deadline, now)


def hard_bound(
    skew: SkewEstimator, ticket: LeaseTicket, params: LeaseParams | None, now: float
) -> float:
    """Earliest local time the holder's max_hold can end the lease (inf if unknown).

    ``params`` are the session's (the Welcome's), else the ticket's cap counts.
    """
    max_hold = params.max_hold if params is not None else None
    if max_hold is None:
        max_hold = ticket.params.max_hold
    if max_hold is None or not skew.known:
        return math.inf if max_hold is None else -math.inf
    # The ticket was minted at deadline - expires_in (issuer's clock); the holder
    # adopted it then or later, so its hard cap is at least that plus max_hold.
    granted = ticket.deadline - ticket.expires_in
    return skew.peer_deadline_to_local(granted + max_hold, now)


def in_sync_bound(
    *,
    claimed_seq: float,
    in_sync_seq: int,
    in_sync_since: float,
    params: LeaseParams | None,
    drift: float,
    skew: SkewEstimator,
    ticket: LeaseTicket,
    now: float,
) -> float:
    """What the last in-sync heartbeat proves about a lease the session holds.

    An in-sync heartbeat (count and digest matched) sent at ``in_sync_since``
    renewed every lease claimed by then (``claimed_seq <= in_sync_seq``) to at
    least its arrival plus the extension, and arrival came after sending; but
    never past the holder's hard cap (:func:`hard_bound`).
    """
    if claimed_seq > in_sync_seq or params is None:
        return -math.inf
    renewed = in_sync_since + params.extension * (1 - drift)
    return min(renewed, hard_bound(skew, ticket, params, now))


def acked_bound(sent: float, left: float, drift: float) -> float:
    """An acknowledgement of a heartbeat sent at ``sent`` said ``left`` seconds remained."""
    return sent + left * (1 - drift)


def lapsed(
    *,
    tracked_at: float,
    ticket: LeaseTicket,
    extension: float,
    beats: Iterable[SentBeat],
    drift: float,
    now: float,
) -> bool:
    """The session's own record says the holder's deadline has passed.

    An upper bound ``L``, the mirror of the lower one. The ticket was granted
    before we tracked it: ``L = tracked_at + expires_in`` (plus drift). Then,
    in send order, each heartbeat that left before ``L`` may have renewed the
    lease: an acknowledged one arrived before its acknowledgement came back,
    so ``L = max(L, acked_at + extension)``; an unanswered one may have
    arrived any time, so nothing is known. A heartbeat that left at or after
    ``L`` arrives after the lease ended, and ended leases are never revived
    (S3) -- so the overdue heartbeat sent at the end of the long step does not
    hide the lapse, and neither does its answer. (Frames of a session are
    taken to arrive in order, so an acknowledgement also covers the unanswered
    heartbeats sent before it.) Only this session is counted: if another rank
    of this engine renewed the lease, the read is declined, not deferred -- an
    error here costs a recompute, never safety.
    """
    stretch = 1 + drift
    lapse = tracked_at + ticket.expires_in * stretch
    unknown = False
    for beat in beats:  # in send order
        if beat.sent >= lapse:
            break
        if beat.acked_at is None:
            unknown = True
            continue
        lapse = max(lapse, beat.acked_at + extension * stretch)
        unknown = False
    return not unknown and now >= lapse


def surely_lapsed_at(
    *,
    tracked_at: float,
    ticket: LeaseTicket,
    extension: float,
    beats: Iterable[SentBeat],
    drift: float,
    ack_timeout: float,
) -> float:
    """When the lease has surely lapsed, for a session the holder has not welcomed.

    Like :func:`lapsed`, except that an unanswered heartbeat is taken to have
    arrived within ``ack_timeout``. Wrong only if the network held it longer,
    and then the cost is a recompute: a request failed on this is never read.
    """
    stretch = 1 + drift
    lapse = tracked_at + ticket.expires_in * stretch
    for beat in beats:  # in send order
        if beat.sent >= lapse:
            break
        arrived = beat.acked_at if beat.acked_at is not None else beat.sent + ack_timeout
        lapse = max(lapse, arrived + extension * stretch)
    return lapse
