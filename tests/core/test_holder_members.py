"""Memberships against the per-session sets they replace: same members, order, count, digest."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto import wire
from kvproto.holder_members import NOBODY, SEVERAL, Memberships

_SLOTS = 6
_SERIALS = (1, 2, 3, 4)
_STEP = st.tuples(
    st.sampled_from(["attach", "detach", "clear"]),
    st.integers(0, _SLOTS - 1),
    st.sampled_from(_SERIALS),
)


def _lease_id(slot: int) -> int:
    return 1000 + slot


@settings(max_examples=400, deadline=None)
@given(st.lists(_STEP, max_size=120))
def test_memberships_match_a_set_per_session(steps: list[tuple[str, int, int]]) -> None:
    members = Memberships()
    for _ in range(_SLOTS):
        members.new_slot()
    lists = {serial: members.open(serial) for serial in _SERIALS}
    # The model: each session's leases in join order (what LeaseSet's dict kept).
    model: dict[int, list[int]] = {serial: [] for serial in _SERIALS}
    for op, slot, serial in steps:
        if op == "attach":
            added = members.attach(slot, lists[serial], _lease_id(slot))
            assert added == (slot not in model[serial])
            if added:
                model[serial].append(slot)
        elif op == "detach":
            removed = members.detach(slot, lists[serial], _lease_id(slot))
            assert removed == (slot in model[serial])
            if removed:
                model[serial].remove(slot)
        else:
            members.clear(slot, _lease_id(slot))
            for held in model.values():
                if slot in held:
                    held.remove(slot)
        for each in _SERIALS:
            leases = lists[each]
            assert members.slots(leases) == model[each]
            assert leases.count == len(model[each])
            assert leases.digest == wire.digest(_lease_id(s) for s in model[each])
        for each_slot in range(_SLOTS):
            renewing = {s for s in _SERIALS if each_slot in model[s]}
            assert set(members.holders(each_slot)) == renewing
            assert len(members.holders(each_slot)) == len(renewing)
            assert all(members.holds(each_slot, s) == (s in renewing) for s in _SERIALS)
            expected_holder = (
                NOBODY if not renewing else renewing.pop() if len(renewing) == 1 else SEVERAL
            )
            assert members.holder[each_slot] == expected_holder


def test_holders_are_listed_in_join_order() -> None:
    members = Memberships()
    members.new_slot()
    lists = [members.open(serial) for serial in (5, 3, 9)]
    for leases in lists:
        members.attach(0, leases, 1)
    assert members.holders(0) == (5, 3, 9)
    members.detach(0, lists[0], 1)
    assert members.holders(0) == (3, 9)


def test_only_a_session_that_renews_nothing_closes() -> None:
    members = Memberships()
    members.new_slot()
    leases = members.open(1)
    members.attach(0, leases, 7)
    with pytest.raises(ValueError, match="still renews 1 leases"):
        members.close(leases)
    members.detach(0, leases, 7)
    members.close(leases)
