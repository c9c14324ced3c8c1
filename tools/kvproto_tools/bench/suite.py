"""Runs every section of the benchmark in order, within the run's time budget."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence

from kvproto_tools.bench import (
    anchor,
    holder_bench,
    memory_bench,
    reader_bench,
    scaling,
    transport_bench,
)
from kvproto_tools.bench.figures import Figure
from kvproto_tools.bench.fixtures import build_holder, build_holder_direct
from kvproto_tools.bench.plan import Plan
from kvproto_tools.bench.timing import Budget

Say = Callable[[str], None]

_SAFETY = 1.5
"""Margin on the projected cost of an optional size."""
_PROBE = 10_000


def _holder(
    n: int, plan: Plan, say: Say, *, direct: bool = False
) -> tuple[list[Figure], float, float]:
    """Holder figures at ``n`` leases; also (build seconds, measurement seconds)."""
    start = time.monotonic()
    fx = build_holder_direct(n) if direct else build_holder(n)
    built = time.monotonic() - start
    vllm = anchor.prefill_pair(fx.request_ids, now=fx.now)
    figures = holder_bench.measure(fx, vllm, plan, claim=not direct)
    del fx, vllm
    gc.collect()
    elapsed = time.monotonic() - start
    how = "direct" if direct else "reader"
    say(
        f"holder: {n:>9,} leases  built ({how}) in {built:5.1f} s, "
        f"measured in {elapsed - built:5.1f} s"
    )
    return figures, built, elapsed - built


def _project(n: int, built: dict[int, float], measured: dict[int, float]) -> float:
    """Seconds an extra (direct-built) size would take, pessimistically.

    Building is probed at 10,000 leases (the direct build is linear); the
    measurement is dominated by the anchor's O(n) operations, so it scales
    from the largest size measured so far.
    """
    start = time.monotonic()
    probe = build_holder_direct(_PROBE)
    per_lease = (time.monotonic() - start) / _PROBE
    del probe
    gc.collect()
    largest = max(measured)
    return (per_lease * n + measured[largest] * n / largest) * _SAFETY


HOLDER_NAMES = (
    "holder.idle_step",
    "holder.idle_step.vs_bare_scan",
    "holder.idle_step.vs_head_stop",
    "holder.heartbeat_bytes_per_lease",
    "holder.heartbeat_wire_bytes_per_lease",
    "holder.heartbeat_apply",
    "holder.heartbeat_apply.vs_bare_parse",
    "holder.heartbeat_mac",
    "holder.claim_mac_per_lease",
    "holder.done_mac",
    "holder.claim_ticks",
    "holder.claim_bytes_per_lease",
    "holder.claim_ack_bytes_per_lease",
    "holder.claim_apply_per_lease",
    "holder.claim_floor",
)
READER_NAMES = (
    "reader.track",
    "reader.track_floor",
    "reader.idle_step",
    "reader.heartbeat_tick",
    "reader.heartbeat_bytes_per_request",
)
MEMORY_NAMES = ("memory.per_lease", "memory.gc_full_collect", "memory.gc_pause_added")
TRANSPORT_NAMES = (
    "transport.loopback.heartbeat_rtt",
    "transport.loopback.heartbeat_rtt_cores",
    "transport.loopback.read64_confirmed",
)
SCALING_NAMES = ("scaling.idle_step.exponent", "scaling.heartbeat_apply.exponent")


CORE_SUITES = ("core", "memory", "transport")
"""In-process suites (no engine); ``kvproto bench`` runs all three unless told otherwise."""


def expected_names(plan: Plan, suites: Sequence[str] = CORE_SUITES) -> set[str]:
    """Every figure name a run of ``plan`` produces (NIXL/UCX ones excepted: optional)."""
    names: set[str] = set()
    if "core" in suites:
        names |= set(HOLDER_NAMES) | set(SCALING_NAMES)
        names |= {f"{base}.e{e}" for base in READER_NAMES for e in plan.reader_engines}
    if "memory" in suites:
        names |= set(MEMORY_NAMES)
    if "transport" in suites:
        names |= set(TRANSPORT_NAMES)
    return names


def run(
    plan: Plan, say: Say, *, transports: bool = True, suites: Sequence[str] = CORE_SUITES
) -> list[Figure]:
    """All figures of ``plan`` for ``suites``, in the order they have always run;
    optional sizes that would overrun the budget are skipped."""
    budget = Budget(plan.budget_s)
    core = "core" in suites
    figures: list[Figure] = []
    cost: dict[int, float] = {}
    measured: dict[int, float] = {}
    for n in plan.holder_sizes if core else ():
        got, cost[n], measured[n] = _holder(n, plan, say)
        figures += got
    for n in plan.reader_sizes if core else ():
        for engines in plan.reader_engines:
            start = time.monotonic()
            figures += reader_bench.measure(n, engines, plan)
            say(
                f"reader: {n:>9,} requests over {engines:>2} engines "
                f"in {time.monotonic() - start:5.1f} s"
            )
    if "memory" in suites:
        start = time.monotonic()
        figures += memory_bench.measure(plan.memory_size)
        say(f"memory: {plan.memory_size:>9,} leases in {time.monotonic() - start:5.1f} s")
    if "transport" in suites:
        start = time.monotonic()
        figures += transport_bench.measure(plan, say, external=transports)
        say(f"transport: in {time.monotonic() - start:5.1f} s")
    for n in plan.scaling_extra if core else ():
        projected = _project(n, cost, measured)
        if projected > budget.left():
            say(
                f"scaling: {n:,} leases skipped (projected {projected:.0f} s, "
                f"{budget.left():.0f} s left of the {plan.budget_s:.0f} s budget)"
            )
            continue
        got, cost[n], measured[n] = _holder(n, plan, say, direct=True)
        figures += got
    if core:
        figures += scaling.growth_figures(figures)
    say(f"total: {budget.elapsed():.1f} s")
    return figures
