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


def test_a_code_retained_for_several_leases_is_freed_by_their_last_release() -> None:
    claimers = Claimers()
    code = claimers.acquire("D", 1, 1)
    claimers.retain(code, 2)  # a frame's claims take the code once, then count the rest
    for _ in range(2):
        claimers.release(code)
        assert claimers.engines[code] == "D"
    claimers.release(code)
    assert len(claimers) == 0 and claimers.engines[code] is None
