"""Claimers: one code per distinct first claimer, reused once no lease names it."""

from __future__ import annotations

from kvproto.holder_claimers import UNCLAIMED, Claimers


def test_leases_claimed_alike_share_a_code_until_the_last_lets_go() -> None:
    claimers = Claimers()
    first = claimers.acquire("D", 2, 1)
    assert claimers.acquire("D", 2, 1) == first != UNCLAIMED
    other = claimers.acquire("D", 4, 2)
    assert other != first
    assert (claimers.engines[other], claimers.tps[other], claimers.expected[other]) == ("D", 4, 2)
    claimers.release(first)
    assert claimers.engines[first] == "D" and len(claimers) == 2
    claimers.release(first)
    claimers.release(UNCLAIMED)  # an unclaimed lease names no claimer
    assert len(claimers) == 1
    assert claimers.acquire("legacy:x", 0, 0) == first  # the freed code is reused
    assert claimers.engines[UNCLAIMED] is None
