"""RequestIndex against the dict it replaces: every indexed request id finds its slot."""

from __future__ import annotations

import gc

from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.holder_requests import RequestIndex

_SLOTS = 12
# A small alphabet: ids repeat (a newer slot takes an id over) and share hash homes.
_IDS = st.text("ab", max_size=3)
_STEP = st.tuples(st.sampled_from(["set", "clear"]), st.integers(0, _SLOTS - 1), _IDS)


@settings(max_examples=400, deadline=None)
@given(st.lists(_STEP, max_size=150))
def test_request_index_matches_a_dict(steps: list[tuple[str, int, str]]) -> None:
    index = RequestIndex()
    for slot in range(_SLOTS):
        index.set(slot, "")  # the table grows a slot at a time, with no request id yet
    names = [""] * _SLOTS  # the model: slot -> request id, and request id -> newest slot
    newest: dict[str, int] = {}
    for op, slot, request_id in steps:
        if op == "set" and not names[slot]:
            index.set(slot, request_id)
            names[slot] = request_id
            if request_id:
                newest[request_id] = slot
        elif op == "clear":
            index.clear(slot)
            if names[slot] and newest.get(names[slot]) == slot:
                del newest[names[slot]]
            names[slot] = ""
        assert [index.name(slot) for slot in range(_SLOTS)] == names
        for name in {request_id, *names, *newest}:
            assert index.find(name) == newest.get(name)


def test_ids_resolve_across_the_table_growing_and_runs_closing() -> None:
    index = RequestIndex()
    ids = [f"cmpl-{i:08x}-0" for i in range(5000)]
    for slot, request_id in enumerate(ids):
        index.set(slot, request_id)
    for slot in range(0, len(ids), 3):
        index.clear(slot)
    for slot, request_id in enumerate(ids):
        assert index.find(request_id) == (None if slot % 3 == 0 else slot)
    for slot in range(0, len(ids), 3):
        index.set(slot, ids[slot])
    assert all(index.find(request_id) == slot for slot, request_id in enumerate(ids))


def test_the_collector_never_walks_the_request_ids() -> None:
    """The id strings sit in tuples the collector untracks, so a full collection
    visits a chunk list, not a reference per lease."""
    index = RequestIndex()
    for slot in range(1000):
        index.set(slot, f"cmpl-{slot:08x}-0")
    index.clear(7)
    gc.collect()
    chunks = [chunk for chunk in gc.get_referents(index) if isinstance(chunk, list)]
    assert len(chunks) == 1 and len(chunks[0]) == 1000 // 32 + 1
    assert not any(gc.is_tracked(chunk) for chunk in chunks[0])
    assert index.name(7) == "" and index.name(8) == "cmpl-00000008-0"
