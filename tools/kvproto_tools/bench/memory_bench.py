"""Memory per live lease (tracemalloc) and the pause of a full GC pass with them alive.

Two pauses: the whole process's (``memory.gc_full_collect``, what an engine
step would see, dominated by the process's own objects and as noisy as they
are), and the part the lease table alone adds (``memory.gc_pause_added``):
the process's objects are frozen out of the collector (``gc.freeze``) before
the table is built, so a collection walks only what the build left.

Request-id strings are created before tracing starts: the engine holds them
anyway, and both sides key by them, so neither side is charged for them.
The kvproto side is measured in the steady state (leases claimed into a
reader session), the state a live lease spends its life in; the tickets and
frames used to get there (:class:`~.fixtures.WireReader`'s, so that no
Reader is traced) are freed before the reading.
"""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable

from kvproto_tools.bench import anchor
from kvproto_tools.bench.figures import Figure
from kvproto_tools.bench.fixtures import build_holder_direct, vllm_request_ids


def _traced_bytes(build: Callable[[], object]) -> tuple[int, object]:
    """Bytes still allocated after ``build()`` returns (its result kept alive)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = build()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return after - before, kept


def _gc_samples_ms(repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        gc.collect()
        samples.append((time.perf_counter_ns() - start) / 1e6)
    return samples


def _gc_ms(repeats: int = 3) -> float:
    return statistics.median(_gc_samples_ms(repeats))


def _built_alone(build: Callable[[], object]) -> tuple[int, object, float]:
    """``_traced_bytes(build)`` plus the pause of a full collection that walks only
    what the build left alive (min of 9: the least the structure costs a pass)."""
    gc.collect()
    gc.freeze()
    try:
        size, kept = _traced_bytes(build)
        added = min(_gc_samples_ms(9))
    finally:
        gc.unfreeze()
    return size, kept, added


def measure(n: int) -> list[Figure]:
    """Bytes per live lease and a full collection's pause, kvproto holder vs vLLM v4."""
    ids = vllm_request_ids(n)

    def ours() -> object:
        fx = build_holder_direct(n, ids)
        return fx.holder  # tickets and claim frames are dropped here

    ours_bytes, holder, ours_added = _built_alone(ours)
    ours_gc = _gc_ms()
    del holder
    gc.collect()

    def theirs() -> object:
        return anchor.vllm_prefill(ids, reaper="full-scan")

    theirs_bytes, prefill, theirs_added = _built_alone(theirs)
    theirs_gc = _gc_ms()
    del prefill
    gc.collect()
    return [
        Figure(
            name="memory.per_lease",
            size=n,
            value=ours_bytes / n,
            unit="B",
            anchor="vllm-lease lease dict",
            anchor_value=theirs_bytes / n,
        ),
        Figure(
            name="memory.gc_full_collect",
            size=n,
            value=ours_gc,
            unit="ms",
            anchor="vllm-lease lease dict",
            anchor_value=theirs_gc,
        ),
        Figure(
            name="memory.gc_pause_added",
            size=n,
            value=ours_added,
            unit="ms",
            anchor="vllm-lease lease dict",
            anchor_value=theirs_added,
        ),
    ]
