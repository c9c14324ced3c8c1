"""Memory per live lease (tracemalloc) and the pause of a full GC pass with them alive.

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


def _gc_ms(repeats: int = 3) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        gc.collect()
        samples.append((time.perf_counter_ns() - start) / 1e6)
    return statistics.median(samples)


def measure(n: int) -> list[Figure]:
    """Bytes per live lease and a full collection's pause, kvproto holder vs vLLM v4."""
    ids = vllm_request_ids(n)

    def ours() -> object:
        fx = build_holder_direct(n, ids)
        return fx.holder  # tickets and claim frames are dropped here

    ours_bytes, holder = _traced_bytes(ours)
    ours_gc = _gc_ms()
    del holder
    gc.collect()

    def theirs() -> object:
        return anchor.vllm_prefill(ids, reaper="full-scan")

    theirs_bytes, prefill = _traced_bytes(theirs)
    theirs_gc = _gc_ms()
    del prefill
    gc.collect()
    return [
        Figure(
            name="memory.per_lease",
            size=n,
            value=ours_bytes / n,
            unit="B",
            anchor="vllm-v4 lease dict",
            anchor_value=theirs_bytes / n,
        ),
        Figure(
            name="memory.gc_full_collect",
            size=n,
            value=ours_gc,
            unit="ms",
            anchor="vllm-v4 lease dict",
            anchor_value=theirs_gc,
        ),
    ]
