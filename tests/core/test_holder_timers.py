"""DeadlineQueue against the heap it replaces: the same entries leave in the same order."""

from __future__ import annotations

import heapq
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.holder_timers import LANES, DeadlineQueue

_DUES = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False) | st.sampled_from([0.0, 1.0])
_STEP = st.one_of(
    st.tuples(st.just("push"), _DUES, st.integers(1, 2**64 - 1) | st.integers(1, 8)),
    st.tuples(st.just("take"), _DUES, st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_STEP, max_size=120))
def test_entries_leave_in_heap_order(steps: list[tuple[str, float, int]]) -> None:
    queue = DeadlineQueue()
    heap: list[tuple[float, int]] = []
    for op, due, lease in steps:
        if op == "push":
            queue.push(due, lease)
            heapq.heappush(heap, (due, lease))
        else:
            expected = []
            while heap and heap[0][0] <= due:
                expected.append(heapq.heappop(heap))
            assert queue.take_due(due) == expected
        assert queue.soonest == (heap[0][0] if heap else math.inf)
        assert len(queue) == len(heap)


def test_rising_sequences_beyond_the_lanes_spill_into_the_heap_and_still_order() -> None:
    queue = DeadlineQueue()
    # LANES + 2 interleaved rising sequences, each starting below the one before.
    entries = [
        (float(1000 * (LANES + 2 - s) + i), 10 * i + s) for i in range(5) for s in range(LANES + 2)
    ]
    for due, lease in entries:
        queue.push(due, lease)
    assert queue.take_due(float("inf")) == sorted(entries)
    assert queue.soonest == math.inf and len(queue) == 0
