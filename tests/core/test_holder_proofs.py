"""The messages the holder packs once a session hash to the same proofs as the plain calls.

The holder checks claims and signs HELD verdicts with ``claim_message`` and
``verdict_prover`` (prepared per session, one struct pack a lease); the reader
proves and checks with ``claim_proof`` and ``verdict_proof``. Every claim and
every vouched read depends on the two agreeing byte for byte.
"""

from __future__ import annotations

import hashlib

import pytest

from kvproto import auth
from kvproto.ticket import PROOF_BYTES, claim_message, claim_proof
from kvproto.wire import DoneVerdict

_ENGINES = ["D", "", "décodeur-ø", "e" * 300]
_LEASES = [1, 2**32, 2**64 - 1]
_TOKEN = bytes(range(16))


@pytest.mark.parametrize("engine", _ENGINES)
@pytest.mark.parametrize("lease", _LEASES)
def test_a_claim_message_hashes_to_the_claim_proof(engine: str, lease: int) -> None:
    message = claim_message(engine)(lease)
    proof = hashlib.blake2b(message, key=bytearray(_TOKEN), digest_size=PROOF_BYTES).digest()
    assert proof == claim_proof(_TOKEN, engine, lease)


@pytest.mark.parametrize("engine", _ENGINES)
@pytest.mark.parametrize("lease", _LEASES)
@pytest.mark.parametrize("rank", [0, 7, 2**40])
@pytest.mark.parametrize("verdict", list(DoneVerdict))
def test_a_verdict_prover_gives_the_verdict_proof(
    engine: str, lease: int, rank: int, verdict: DoneVerdict
) -> None:
    proof = auth.verdict_prover(engine, rank)(bytearray(_TOKEN), lease, verdict)
    expected = auth.verdict_proof(
        _TOKEN, lease=lease, verdict=verdict, reader_engine=engine, reader_rank=rank
    )
    assert proof == expected
