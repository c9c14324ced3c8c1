"""Expiry whatever the renewal order (vLLM #58222 / #50789), at O(expired log n) cost."""

from __future__ import annotations

import heapq
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto import holder_book, legacy, wire
from kvproto.config import LeaseConfig
from kvproto.holder import Holder, ended
from kvproto.states import LeaseState

from .net import Net
from .pair import counter_entropy

EXTENSION = 20.0


def test_58222_heartbeated_head_does_not_strand_silent_leases_behind_it() -> None:
    """The first-granted lease is renewed forever (reader D); the later ones belong to a
    reader that went silent (E crashed) or were never claimed. vLLM's reaper walked the
    insertion-ordered map and stopped at the live head, stranding all of them."""
    net = Net()
    net.add_holder("P0")
    net.add_reader("D0")
    net.add_reader("E0", engine="E")
    head = net.grant("P0", "p-head")
    net.track("D0", "head", head)
    silent = []
    for i in range(50):
        net.run_until(0.1 * (i + 1))
        t = net.grant("P0", f"p-{i}")
        silent.append((0.1 * (i + 1), t.lease))
        if i % 2 == 0:
            net.track("E0", f"e{i}", t)  # claimed by E, which then dies
    net.run_until(7.0)
    net.crash("E0")
    net.run_until(1000.0)
    freed = {lease: (t, reason) for t, lease, reason in net.freed_leases()}
    last_e_beat = net.arrivals("E0", "P0", wire.Heartbeat)[-1]
    for granted_at, lease in silent:
        want = max(granted_at + 30.0, last_e_beat + EXTENSION)
        assert freed[lease] == (pytest.approx(want), "EXPIRED"), lease
    assert head.lease not in freed
    assert net.holder("P0").lease_state(head.lease) is LeaseState.HELD
    assert net.holder("P0").live_leases() == 1


def legacy_holder() -> Holder:
    return Holder(
        LeaseConfig(accept_legacy=True), engine="P", incarnation=1, entropy=counter_entropy()
    )


def test_58222_with_stock_vllm_frames_per_lease_renewal() -> None:
    """The exact vLLM shape: per-request renewal by text heartbeat, 480 s turn-2 lease
    granted first, 30 s leases after it (#50789 mixes the TTLs in one map)."""
    h = legacy_holder()
    turn2 = h.grant(0.0, request_id="turn2", ttl=480.0)
    first = h.grant(0.0, request_id="first")
    later = [h.grant(1.0 + i, request_id=f"later{i}") for i in range(20)]
    freed: dict[int, tuple[float, str]] = {}
    t = 0.0
    while t <= 600.0:
        if t <= 400.0:
            h.handle_frame(t, "d-agent", legacy.encode_heartbeat(["first"]))
        h.handle_timer(t)
        for f in ended(h.drain()):
            freed[f.lease] = (t, f.reason.name)
        t += 0.5
    for i, ticket in enumerate(later):
        assert freed[ticket.lease] == (31.0 + i, "EXPIRED")
    assert freed[turn2.lease] == (480.0, "EXPIRED")
    assert freed[first.lease] == (420.0, "EXPIRED")  # last renewal 400 + 20


@settings(max_examples=60, deadline=None)
@given(
    grants=st.lists(
        st.tuples(st.floats(0, 50), st.sampled_from([30.0, 480.0])), min_size=1, max_size=30
    ),
    renewals=st.lists(st.tuples(st.floats(0, 600), st.integers(0, 29)), max_size=80),
)
def test_any_renewal_order_expires_each_lease_exactly_on_time(
    grants: list[tuple[float, float]], renewals: list[tuple[float, int]]
) -> None:
    """Reference model: a lease ends at max(grant + ttl, last renewal + extension),
    checked against the holder driven at exactly every due time."""
    h = legacy_holder()
    events: list[tuple[float, int, str, Any]] = []
    for i, (at, ttl) in enumerate(grants):
        events.append((at, 0, "grant", (i, ttl)))
    for at, idx in renewals:
        events.append((at, 1, "renew", idx % len(grants)))
    events.sort(key=lambda e: (e[0], e[1]))
    lease_of: dict[int, int] = {}
    model: dict[int, float] = {}
    freed: dict[int, float] = {}

    def run_timers(until: float) -> None:
        while (due := h.get_timer()) is not None and due <= until:
            h.handle_timer(due)
            for f in ended(h.drain()):
                freed[f.lease] = due

    for at, _, kind, arg in events:
        run_timers(at)
        if kind == "grant":
            i, ttl = arg
            lease_of[i] = h.grant(at, request_id=f"r{i}", ttl=ttl).lease
            model[lease_of[i]] = at + ttl
        elif arg in lease_of:
            lease = lease_of[arg]
            h.handle_frame(at, f"agent{arg}", legacy.encode_heartbeat([f"r{arg}"]))
            if lease not in freed:
                model[lease] = max(model[lease], at + EXTENSION)
    run_timers(10_000.0)
    assert freed == pytest.approx(model)


class CountingHeapq:
    """Stands in for the heapq module of the holder's session heap and counts every operation."""

    def __init__(self) -> None:
        self.pushes = 0
        self.pops = 0

    def heappush(self, heap: list[Any], item: Any) -> None:
        self.pushes += 1
        heapq.heappush(heap, item)

    def heappop(self, heap: list[Any]) -> Any:
        self.pops += 1
        return heapq.heappop(heap)

    @property
    def ops(self) -> int:
        return self.pushes + self.pops


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> CountingHeapq:
    c = CountingHeapq()
    monkeypatch.setattr(holder_book, "heapq", c)
    return c


def session_with_leases(n: int) -> tuple[Net, list[int]]:
    net = Net()
    net.add_holder("P0")
    net.add_reader("D0")
    leases = []
    for i in range(n):
        t = net.grant("P0", f"p{i}")
        net.track("D0", f"r{i}", t)
        leases.append(t.lease)
    net.run_until(1.0)
    return net, leases


def test_idle_handle_timer_touches_no_lease(counting: CountingHeapq) -> None:
    net, _ = session_with_leases(5000)
    h = net.holder("P0")
    due = h.get_timer()
    assert due is not None
    before = counting.ops
    for k in range(1000):  # a binding calling every engine step, nothing due
        h.handle_timer(1.0 + k * (due - 1.0) / 1000 * 0.999)
    assert counting.ops == before
    assert h.get_timer() == due


def test_heartbeats_cost_constant_heap_work_whatever_the_lease_count(
    counting: CountingHeapq,
) -> None:
    costs = []
    for n in (10, 3000):
        net, _ = session_with_leases(n)
        before = counting.ops
        # Each lease's own grant deadline (30 s) pops once and re-files the lease at its
        # hard cap: one pop and one push per lease per lifetime, not per heartbeat.
        net.run_until(40.0)
        assert counting.ops - before <= 2 * n + 20
        before = counting.ops
        net.run_until(340.0)  # 60 keep-alives, each renewing all n leases
        costs.append(counting.ops - before)
        assert net.holder("P0").live_leases() == n
    small, large = costs
    assert large == small  # independent of n
    assert large <= 2 * 60 + 4  # about one session pop + push per renewal period


def test_expiring_k_of_n_costs_order_k(counting: CountingHeapq) -> None:
    h = Holder(LeaseConfig(), engine="P", incarnation=1, entropy=counter_entropy())
    n, k = 20_000, 25
    for i in range(n):
        h.grant(float(i) * 0.001, request_id=f"r{i}")  # due 30.000 .. 49.999
    before = counting.ops
    h.handle_timer(30.0 + (k - 1) * 0.001 + 1e-9)
    assert len(ended(h.drain())) == k
    assert counting.pops - 0 <= k + 1 and counting.ops - before <= 2 * k + 2
