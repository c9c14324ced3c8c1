"""Lease tickets: the capability a holder hands its reader with the request.

A ticket travels from the holder to the reader the way the request does: in
vLLM's ``kv_transfer_params``, through the routing proxy. It names a compact
lease id (so heartbeats stay small), carries an unguessable 128-bit token
(so nobody who merely reaches the holder's port can keep blocks alive or free
them), and states the lease timing as a relative duration plus, for turn-2
blocks whose ticket may wait minutes at a client, the absolute deadline in the
holder's clock (converted by the reader with the estimated clock offset).

The token itself never goes on the notification channel: frames carry
``claim_proof(token, reader_engine, lease)``, a keyed hash that is useless to
another engine.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from kvproto.config import LeaseParams
from kvproto.errors import RemoteProtocolError

TOKEN_BYTES = 16
PROOF_BYTES = 16
PARAMS_KEY = "kvproto"
"""Key of the ticket inside ``kv_transfer_params``."""
MAX_ID = 2**64 - 1
"""Lease ids and incarnations travel as msgpack uint64."""
MAX_HOLDER_TP = 1024
"""Largest holder TP size a ticket may name (a reader opens one session per holder rank)."""


class LeaseTicket(msgspec.Struct, frozen=True, kw_only=True):
    """What a reader needs to claim, heartbeat and release one lease."""

    holder_engine: str
    """Engine id of the holder (vLLM ``remote_engine_id``)."""
    holder_incarnation: int
    """Incarnation of the holder engine that granted it; a restarted holder has lost the blocks."""
    holder_tp_size: int
    """Holder TP size (which ranks to heartbeat and read from)."""
    lease: int
    """Compact lease id, unique within the holder incarnation."""
    token: bytes
    """128-bit capability; proves the right to renew, finish or abort this lease."""
    params: LeaseParams
    """The holder's lease timing."""
    expires_in: float
    """Seconds the lease had left when the ticket was issued."""
    deadline: float
    """The same deadline in the issuing clock (for conversion with a clock offset)."""
    request_id: str = ""
    """The holder's request id (vLLM ``remote_request_id``), for logs and legacy frames."""

    def to_params(self) -> dict[str, Any]:
        """JSON-safe form for ``kv_transfer_params``."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        out["token"] = self.token.hex()
        return out

    @classmethod
    def from_params(cls, value: Mapping[str, Any]) -> LeaseTicket:
        """Parse :meth:`to_params` output; a typed error for anything else."""
        if not isinstance(value, Mapping):
            raise RemoteProtocolError("ticket must be a mapping")
        data = dict(value)
        token = data.get("token")
        if not isinstance(token, str):
            raise RemoteProtocolError("ticket token must be a hex string")
        try:
            data["token"] = bytes.fromhex(token)
            ticket = msgspec.convert(data, cls)
        except (ValueError, msgspec.ValidationError) as exc:
            raise RemoteProtocolError(f"bad ticket: {exc}") from None
        problem = ticket_problem(ticket)
        if problem is not None:
            raise RemoteProtocolError(f"bad ticket: {problem}")
        return ticket


def ticket_problem(ticket: LeaseTicket) -> str | None:
    """Why ``ticket`` is unusable, or None.

    A ticket crosses the routing proxy, so every field is checked before it
    reaches arithmetic or the wire: a lease id beyond uint64 cannot be framed,
    a huge TP size would make the reader open that many sessions, and NaN or
    infinite times defeat every deadline comparison.
    """
    p = ticket.params
    if len(ticket.token) != TOKEN_BYTES:
        return f"token must be {TOKEN_BYTES} bytes"
    if not 1 <= ticket.lease <= MAX_ID:
        return f"lease id {ticket.lease} outside 1..2**64-1"
    if not 0 <= ticket.holder_incarnation <= MAX_ID:
        return "holder incarnation outside uint64"
    if not 1 <= ticket.holder_tp_size <= MAX_HOLDER_TP:
        return f"holder TP size {ticket.holder_tp_size} outside 1..{MAX_HOLDER_TP}"
    # Every track and adopt checks a ticket: one test of the sum first. A sum is finite
    # only if every term is (an inf or a NaN term makes it inf or NaN); a finite sum
    # settles it, and only a sum that is not (a bad term, or an overflow) looks closer.
    finite = math.isfinite
    total = p.duration + p.interval + p.extension + ticket.expires_in + ticket.deadline
    if not finite(total) and not (
        finite(p.duration)
        and finite(p.interval)
        and finite(p.extension)
        and finite(ticket.expires_in)
        and finite(ticket.deadline)
    ):
        return "non-finite time"
    if p.max_hold is not None and not (finite(p.max_hold) and p.max_hold > 0):
        return "max_hold must be a positive number of seconds"
    if not 1 <= p.interval < p.extension <= p.duration:
        return "lease parameters are nonsense"
    if ticket.expires_in <= 0:
        return "lease already expired when issued"
    return None


_CLAIM_DOMAIN = b"kvproto-claim\x00"


def claim_message(reader_engine: str) -> Callable[[int], bytes]:
    """What a claim proof hashes for one claiming engine: ``message(lease)``.

    ``"kvproto-claim\\0" || reader_engine || "\\0" || u64(lease)`` (big-endian).
    The engine's part is packed once; each lease's message is then one C call (a
    struct pack of that part and the lease), not a method call and a
    concatenation.
    """
    head = _CLAIM_DOMAIN + reader_engine.encode() + b"\x00"
    return functools.partial(struct.Struct(f">{len(head)}sQ").pack, head)


def claim_prover(reader_engine: str) -> Callable[[bytes | bytearray, int], bytes]:
    """The claim proof for one claiming engine: ``prove(token, lease)``.

    A keyed hash proving knowledge of the lease's token, bound to the claiming
    engine and the lease: BLAKE2b-128 of :func:`claim_message` keyed by the
    token. A reader proves each ticket it tracks with its engine's prover, made
    once. The holder checks a frame's claims in one loop
    (:meth:`kvproto.holder_claims.Claims.check`) that hashes the same message
    inline; tests/core/test_claim_check.py holds the two equal.
    """
    message = claim_message(reader_engine)
    blake2b = hashlib.blake2b

    def prove(token: bytes | bytearray, lease: int) -> bytes:
        return blake2b(message(lease), key=token, digest_size=PROOF_BYTES).digest()

    return prove


def claim_proof(token: bytes, reader_engine: str, lease: int) -> bytes:
    """One claim proof (:func:`claim_prover`'s), for a caller proving just one."""
    return claim_prover(reader_engine)(token, lease)


class LeaseMint:
    """Allocates lease ids and tokens for one holder engine incarnation.

    In vLLM the scheduler process mints (at ``request_finished``) and every
    worker's :class:`~kvproto.holder.Holder` adopts the ticket; a single-process
    holder mints for itself.
    """

    def __init__(
        self,
        *,
        engine: str,
        incarnation: int,
        tp_size: int,
        params: LeaseParams,
        entropy: Callable[[int], bytes],
    ) -> None:
        self._engine = engine
        self._incarnation = incarnation
        self._tp_size = tp_size
        self._params = params
        self._entropy = entropy
        self._next = 1

    def mint(self, now: float, *, request_id: str, ttl: float) -> LeaseTicket:
        """A fresh ticket for a lease of ``ttl`` seconds starting at ``now``."""
        lease = self._next
        self._next += 1
        token = self._entropy(TOKEN_BYTES)
        return LeaseTicket(
            holder_engine=self._engine,
            holder_incarnation=self._incarnation,
            holder_tp_size=self._tp_size,
            lease=lease,
            token=token,
            params=self._params,
            expires_in=ttl,
            deadline=now + ttl,
            request_id=request_id,
        )
