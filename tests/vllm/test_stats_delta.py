"""DeltaTracker's fast path (one tuple comparison when no counter moved) changes nothing.

Against the per-key loop it replaced, restated here as the reference: for any
sequence of snapshots -- counters that move or not, gauges that change, keys
that appear, disappear or change order -- both return the same deltas and
gauges, or both return None.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from .vllm_required import require_vllm

require_vllm()

from kvproto_vllm.stats import GAUGES, DeltaTracker  # noqa: E402

KEYS = ["holder_grants", "reader_tracked", "binding_unroutable", *sorted(GAUGES)[:3]]


class ReferenceTracker:
    """The loop over every key that DeltaTracker.delta ran at each step before."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._last_gauges: dict[str, int] | None = None

    def delta(self, snapshot: dict[str, int]) -> dict[str, Any] | None:
        counters = {}
        gauges = {}
        for key, value in snapshot.items():
            if key in GAUGES:
                gauges[key] = value
                continue
            change = value - self._last.get(key, 0)
            if change:
                counters[key] = change
            self._last[key] = value
        if not counters and gauges == self._last_gauges:
            return None
        self._last_gauges = gauges
        return {"counters": counters, "gauges": {"e/0": gauges}}


snapshots = st.lists(
    st.lists(st.sampled_from(KEYS), unique=True, min_size=1).flatmap(
        lambda keys: st.fixed_dictionaries({k: st.integers(0, 3) for k in keys})
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(snapshots)
def test_fast_path_equals_the_per_key_loop(steps: list[dict[str, int]]) -> None:
    fast, reference = DeltaTracker("e/0"), ReferenceTracker()
    for snapshot in steps:
        got = fast.delta(dict(snapshot))
        want = reference.delta(dict(snapshot))
        assert (got.data if got is not None else None) == want, snapshot


def test_an_idle_step_reports_nothing_and_a_gauge_alone_is_reported() -> None:
    tracker = DeltaTracker("e/0")
    first = tracker.delta({"holder_grants": 2, "worker_pump_gap_ms_max": 4})
    assert first is not None and first.data["counters"] == {"holder_grants": 2}
    assert tracker.delta({"holder_grants": 2, "worker_pump_gap_ms_max": 4}) is None
    gap_only = tracker.delta({"holder_grants": 2, "worker_pump_gap_ms_max": 9})
    assert gap_only is not None
    assert gap_only.data == {"counters": {}, "gauges": {"e/0": {"worker_pump_gap_ms_max": 9}}}
