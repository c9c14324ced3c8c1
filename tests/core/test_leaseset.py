"""LeaseSet's count and digest: the values heartbeats carry, so both sides must agree."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvproto import wire
from kvproto.leaseset import SCATTER, LeaseSet, digest_add, digest_of_sum, digest_remove

_IDS = st.integers(min_value=0, max_value=wire.MAX_U64)


@given(digest=_IDS, lease=_IDS)
def test_the_incremental_digest_is_the_wire_digest(digest: int, lease: int) -> None:
    assert digest_add(digest, lease) == (digest + wire.id_hash(lease)) & wire.MAX_U64
    assert digest_remove(digest, lease) == (digest - wire.id_hash(lease)) & wire.MAX_U64


@given(ids=st.lists(_IDS))
def test_a_digest_is_the_sum_of_the_ids_scattered(ids: list[int]) -> None:
    assert (sum(ids) * SCATTER) & wire.MAX_U64 == wire.digest(ids)
    assert digest_of_sum(sum(ids)) == wire.digest(ids)


@given(ops=st.lists(st.tuples(st.booleans(), st.integers(min_value=0, max_value=40))))
def test_count_and_digest_describe_the_set_of_ids(ops: list[tuple[bool, int]]) -> None:
    leases: LeaseSet[str] = LeaseSet()
    model: set[int] = set()
    for add, lease in ops:
        if add:
            leases.add(lease, f"r{lease}")
            model.add(lease)
        else:
            assert leases.discard(lease) == (lease in model)
            model.discard(lease)
        assert leases.count == len(model)
        assert leases.digest == wire.digest(model)
    leases.clear()
    assert (leases.count, leases.digest) == (0, 0)
