"""The per-lease proofs: each built once, as the spec writes it, and the holder's inline check.

The claim and verdict proofs are each defined once (:func:`kvproto.ticket.claim_prover`,
:func:`kvproto.auth.verdict_prover`); here they are held to the messages spec/wire-format.md
spells out, on random inputs. The holder checks a frame's claims in one loop that does
inline what :class:`~kvproto.holder_leases.LeaseTable`'s lookups and the claim prover do
(:meth:`kvproto.holder_claims.Claims.check`): it is held to a reference written with those
methods, on random lease tables and frames.
"""

from __future__ import annotations

import copy
import hashlib
import hmac
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto import auth, wire
from kvproto.config import LeaseConfig
from kvproto.events import ReleaseReason
from kvproto.holder_book import LeaseBook, PeerSession
from kvproto.holder_claims import Claims
from kvproto.holder_leases import LeaseTable
from kvproto.ratelimit import TokenBucket
from kvproto.states import LeaseInput
from kvproto.stats import HolderStats
from kvproto.ticket import TOKEN_BYTES, LeaseTicket, claim_message, claim_proof, claim_prover

_U64 = st.integers(min_value=0, max_value=2**64 - 1)
_LEASES = st.integers(min_value=1, max_value=2**64 - 1)
_TOKENS = st.binary(min_size=TOKEN_BYTES, max_size=TOKEN_BYTES)
_ENGINES = st.text(max_size=40)


def _u64(value: int) -> bytes:
    return value.to_bytes(8, "big")


@given(token=_TOKENS, engine=_ENGINES, lease=_LEASES)
def test_the_claim_proof_is_the_spec_s(token: bytes, engine: str, lease: int) -> None:
    message = b"kvproto-claim\x00" + engine.encode() + b"\x00" + _u64(lease)
    expected = hashlib.blake2b(message, key=token, digest_size=16).digest()
    assert claim_message(engine)(lease) == message
    assert claim_prover(engine)(bytearray(token), lease) == expected
    assert claim_proof(token, engine, lease) == expected


@given(token=_TOKENS, engine=_ENGINES, rank=_U64, lease=_LEASES, verdict=_U64)
def test_the_verdict_proof_is_the_spec_s(
    token: bytes, engine: str, rank: int, lease: int, verdict: int
) -> None:
    message = b"".join(
        (b"kvproto-verdict\x00", engine.encode(), b"\x00", _u64(rank), _u64(lease), _u64(verdict))
    )
    expected = hashlib.blake2b(message, key=token, digest_size=16).digest()
    assert auth.verdict_prover(engine, rank)(bytearray(token), lease, verdict) == expected
    one = auth.verdict_proof(
        token, lease=lease, verdict=verdict, reader_engine=engine, reader_rank=rank
    )
    assert one == expected


# ------------------------------------------------------------ the holder's inline check


@dataclass(frozen=True)
class Lease:
    lease: int
    token: bytes
    fate: str
    """live, ended (a terminal state, tombstoned) or owned (claimed by another engine)."""


# Ids in a few residues modulo the table's first index size, so homes collide and the
# overflow dict is used; plus ids the table never held.
_IDS = st.builds(
    lambda residue, k: residue + 1024 * k,
    st.sampled_from([1, 2, 3, 1023]),
    st.integers(min_value=0, max_value=2**40),
)
_TABLES = st.lists(
    st.builds(Lease, _IDS, _TOKENS, st.sampled_from(["live", "live", "ended", "owned"])),
    max_size=24,
    unique_by=lambda lease: lease.lease,
)


def _ticket(lease: Lease) -> LeaseTicket:
    return LeaseTicket(
        holder_engine="P",
        holder_incarnation=1,
        holder_tp_size=1,
        lease=lease.lease,
        token=lease.token,
        params=LeaseConfig().params,
        expires_in=30.0,
        deadline=30.0,
    )


def _book(leases: list[Lease]) -> LeaseBook:
    book = LeaseBook(LeaseConfig(), HolderStats())
    for lease in leases:
        book.hold(0.0, _ticket(lease))
        slot = book.leases.slot(lease.lease)
        assert slot is not None
        if lease.fate == "ended":
            book.end(0.0, slot, LeaseInput.REVOKE, ReleaseReason.REVOKED)
        elif lease.fate == "owned":
            book.leases.set_claimer(slot, "another engine", tp=1, expected=1)
    return book


def _session(book: LeaseBook, engine: str) -> PeerSession:
    hello = wire.Hello(engine=engine, rank=0, tp_size=2, incarnation=1, nonce=b"n" * 16)
    bucket = TokenBucket(1.0, 1.0, 0.0)
    session = PeerSession(1, "D0", hello, bucket, book.leases.members.open(1))
    session.expected = 2
    return session


def _reference(
    table: LeaseTable, session: PeerSession, claims: list[wire.Claim], stats: HolderStats
) -> list[int | None]:
    """What Claims.check does, one claim at a time with the table's own methods."""
    slots: list[int | None] = []
    for claim in claims:
        slot = table.slot(claim.lease)
        if slot is None:
            stats.unknown_lease += 1
            slots.append(None)
            continue
        owner = table.owner(slot)
        if owner is not None and owner != session.engine:
            stats.owner_mismatch += 1
            slots.append(None)
            continue
        proof = claim_prover(session.engine)(table.token(slot), claim.lease)
        if not hmac.compare_digest(proof, claim.proof):
            stats.bad_proof += 1
            slots.append(None)
            continue
        if owner is None and not table.terminal(slot):
            table.set_claimer(slot, session.engine, tp=session.tp_size, expected=session.expected)
            stats.claims += 1
        slots.append(slot)
    return slots


def _claimers(table: LeaseTable) -> list[tuple[str | None, int, int, int]]:
    """Each slot's claimer (engine, TP, expected) and how many slots name it."""
    codes = [table.claimer[slot] for slot in range(len(table.ids))]
    c = table.claimers
    return [(c.engines[k], c.tps[k], c.expected[k], codes.count(k)) for k in codes]


@settings(max_examples=300, deadline=None)
@given(
    leases=_TABLES,
    engine=st.sampled_from(["D", "another engine", "décodeur"]),
    picks=st.lists(
        st.tuples(st.integers(min_value=0), st.sampled_from(["right", "wrong", "unknown"])),
        max_size=40,
    ),
)
def test_the_holder_s_claim_check_agrees_with_the_table_s_methods(
    leases: list[Lease], engine: str, picks: list[tuple[int, str]]
) -> None:
    claims = []
    for index, kind in picks:
        if kind == "unknown" or not leases:
            claims.append(wire.Claim(lease=2**64 - 1 - index % 1000, proof=b"\x00" * 16))
            continue
        lease = leases[index % len(leases)]
        token = lease.token if kind == "right" else bytes(16)
        claims.append(wire.Claim(lease=lease.lease, proof=claim_proof(token, engine, lease.lease)))
    book = _book(leases)
    twin = copy.deepcopy(book)
    session, twin_session = _session(book, engine), _session(twin, engine)

    got = Claims(book).check(session, claims)
    expected = _reference(twin.leases, twin_session, claims, twin.stats)

    assert got == expected
    assert book.stats == twin.stats
    assert _claimers(book.leases) == _claimers(twin.leases)
