"""LeaseTable against the dicts it replaces: ids and request ids resolve to their lease's slot."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.config import LeaseConfig
from kvproto.holder_leases import LeaseTable
from kvproto.ticket import MAX_ID, LeaseTicket

# Ids that share a home slot at every table size (multiples of 2**20 apart), a few
# sequential ones, and any uint64: the ways ids reach a holder.
_IDS = st.integers(1, 40) | st.integers(1, 8).map(lambda k: k * 2**20 + 3) | st.integers(1, MAX_ID)
_STEP = st.tuples(st.sampled_from(["add", "forget", "lookup"]), _IDS)


def _ticket(lease: int) -> LeaseTicket:
    return LeaseTicket(
        holder_engine="P",
        holder_incarnation=1,
        holder_tp_size=1,
        lease=lease,
        token=lease.to_bytes(16, "big"),
        params=LeaseConfig().params,
        expires_in=30.0,
        deadline=30.0,
        request_id=f"req-{lease}",
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(_STEP, max_size=300))
def test_every_held_id_resolves_to_its_own_slot(steps: list[tuple[str, int]]) -> None:
    table, held = LeaseTable(), set()
    for op, lease in steps:
        if op == "add" and lease not in held:
            slot = table.add(_ticket(lease), 0.0, 600.0)
            held.add(lease)
            assert table.slot(lease) == slot
        elif op == "forget":
            table.forget(lease)
            held.discard(lease)
        assert (lease in table) == (lease in held)
        assert table.has_request(f"req-{lease}") == (lease in held)
        assert len(table) == len(held)
    for lease in held:
        found = table.slot(lease)
        assert found is not None and table.ids[found] == lease
        assert table.slot_of_request(f"req-{lease}") == found
        assert table.token(found) == lease.to_bytes(16, "big")


def test_slots_of_forgotten_leases_are_reused_and_start_clean() -> None:
    table = LeaseTable()
    first = table.add(_ticket(1), 0.0, 600.0)
    table.set_claimer(first, "D", tp=1, expected=1)
    seven, eight = table.members.open(7), table.members.open(8)
    table.members.attach(first, seven, 1)
    table.members.attach(first, eight, 1)
    table.forget(1)
    # Forgotten while two sessions renewed it: neither names it any more.
    assert [(s.count, s.digest, table.members.slots(s)) for s in (seven, eight)] == [(0, 0, [])] * 2
    again = table.add(_ticket(2**20 + 1), 5.0, 600.0)
    assert again == first and table.slot(1) is None
    # Nothing of the first lease's claim is taken for the new lease's: a claim's proof
    # is derived from the slot's token and id, and its first claimer's figures by code.
    assert table.ids[again] == 2**20 + 1 and table.token(again) == _ticket(2**20 + 1).token
    code = table.claimer[again]
    assert table.owner(again) is None
    assert (table.claimers.tps[code], table.claimers.expected[code]) == (0, 0)
    assert len(table.claimers) == 0
    assert table.members.holders(again) == () and table.own[again] == 35.0


def test_ids_resolve_across_the_index_growing_with_collisions_and_frees() -> None:
    table = LeaseTable()
    ids = list(range(1, 3001)) + [i * 2**20 + 5 for i in range(1, 200)]
    for lease in ids:
        table.add(_ticket(lease), 0.0, 600.0)
    for lease in ids[::3]:
        table.forget(lease)
    kept = [lease for i, lease in enumerate(ids) if i % 3]
    assert len(table) == len(kept)
    assert all(table.ids[table.slot(lease) or 0] == lease for lease in kept)
    assert all(table.slot(lease) is None for lease in ids[::3])
