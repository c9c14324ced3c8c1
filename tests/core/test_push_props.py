"""The write fence under random schedules (hypothesis): S1w and the quarantine's end.

One D holder rank and one or two P writer ranks over links that drop, duplicate and
reorder; each run draws when P tracks and writes, how long the write takes and whether
it fails, whether D revokes, P finishes or aborts, and whether P dies (silently, or
with the loss reported later). After every run:

* S1w (spec/push-mode.md §3): no write's data could land after D let the blocks go,
  and a lease freed DONE was filled by writes that all landed before (``check_write_fence``);
* S4: at most one ``FreeBlocks`` per lease, and a ``WriteFenced`` only before it;
* the quarantine ends on evidence: once the transport reports every writer lost, the
  lease is freed (nothing is stranded when loss is reported).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.events import ReadGo
from kvproto.states import WriteState

from .net import LinkFaults
from .pushnet import PushNet


@dataclass(frozen=True)
class Plan:
    writers: int
    faults: LinkFaults
    track_at: float
    write_at: float
    write_for: float
    write_fails: bool
    revoke_at: float | None
    finish_at: float | None
    crash_at: float | None
    detect_after: float | None


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    times = st.floats(min_value=0.0, max_value=60.0, allow_nan=False)
    maybe = st.one_of(st.none(), times)
    return Plan(
        writers=draw(st.sampled_from([1, 2])),
        faults=LinkFaults(
            drop=draw(st.sampled_from([0.0, 0.1, 0.3])),
            duplicate=draw(st.sampled_from([0.0, 0.2])),
            reorder=draw(st.sampled_from([0.0, 0.2])),
            reorder_window=draw(st.sampled_from([0.001, 0.5, 3.0])),
            jitter=draw(st.sampled_from([0.0, 0.5, 3.0])),
            delay=draw(st.sampled_from([0.0, 0.01, 0.2])),
        ),
        track_at=draw(st.floats(min_value=0.0, max_value=10.0, allow_nan=False)),
        write_at=draw(times),
        write_for=draw(st.floats(min_value=0.0, max_value=80.0, allow_nan=False)),
        write_fails=draw(st.booleans()),
        revoke_at=draw(maybe),
        finish_at=draw(maybe),
        crash_at=draw(maybe),
        detect_after=draw(st.one_of(st.none(), st.floats(min_value=0.0, max_value=30.0))),
    )


def _run(plan: Plan, seed: int) -> tuple[PushNet, int]:
    net = PushNet(seed=seed)
    net.links.default = plan.faults
    net.add_holder("D0", engine="D")
    writers = [f"P{r}" for r in range(plan.writers)]
    for rank, name in enumerate(writers):
        net.add_reader(name, engine="P", rank=rank, tp_size=plan.writers)
    ticket = net.grant_writable("D0", "d-r1")

    def track() -> None:
        for name in writers:
            if not net.nodes[name].crashed:
                net.track_writer(name, "r1", ticket)

    def write() -> None:
        for name in writers:
            core = net.reader(name)
            if net.nodes[name].crashed or not core.is_tracked("r1"):
                continue
            if core.write_ready("r1"):
                net.start_write(name, "r1", plan.write_for, fail=plan.write_fails)
            elif core.state("r1")[0] is not None:
                net.collect()

    def revoke() -> None:
        holder = net.holder("D0")
        if holder.is_live(ticket.lease):
            holder.revoke(net.local("D0"), ticket.lease)
            net.collect()

    def finish() -> None:
        for name in writers:
            if not net.nodes[name].crashed and net.reader(name).is_tracked("r1"):
                net.finish(name, "r1")

    net.at(plan.track_at, track)
    net.at(plan.track_at + plan.write_at, write)
    if plan.revoke_at is not None:
        net.at(plan.revoke_at, revoke)
    if plan.finish_at is not None:
        net.at(plan.track_at + plan.finish_at, finish)
    if plan.crash_at is not None:
        at = plan.crash_at
        net.at(at, lambda: net.crash(writers[-1], detect_after=plan.detect_after))
    net.run_until(400.0)
    return net, ticket.lease


@settings(max_examples=300, deadline=None)
@given(plan=plans(), seed=st.integers(min_value=0, max_value=2**16))
def test_no_write_lands_in_released_blocks(plan: Plan, seed: int) -> None:
    net, lease = _run(plan, seed)
    net.check_write_fence()
    freed = net.freed_at("D0", lease)  # asserts S4: at most once
    fenced = [t for t, _, f in net.fenced if f.lease == lease]
    assert len(fenced) <= 1
    if fenced:
        assert fenced[0] <= freed
    holder = net.holder("D0")
    if freed < math.inf:
        assert holder.write_state(lease) is WriteState.SETTLED
    # Evidence ends every quarantine: report each writer lost, and the blocks come back.
    for name in [n for n in net.nodes if n.startswith("P")]:
        holder.peer_lost(net.local("D0"), name)
    net.collect()
    net.run_until(net.now + 1000.0)
    assert net.freed_at("D0", lease) < math.inf
    assert holder.write_state(lease) is WriteState.SETTLED
    assert holder.stats_snapshot()["leases_quarantined"] == 0
    net.check_write_fence()


@settings(max_examples=100, deadline=None)
@given(
    write_at=st.floats(min_value=0.0, max_value=20.0, allow_nan=False),
    write_for=st.floats(min_value=0.0, max_value=5.0, allow_nan=False),
)
def test_a_healthy_writer_always_fills_the_blocks(write_at: float, write_for: float) -> None:
    # No faults, no failure: every write that begins is used (DONE, P confirmed), and
    # nothing is ever fenced.
    net = PushNet()
    net.add_holder("D0", engine="D")
    net.add_reader("P0", engine="P")
    ticket = net.grant_writable("D0", "d-r1")
    net.track_writer("P0", "r1", ticket)
    net.run_until(write_at)
    go = net.start_write("P0", "r1", write_for)
    assert isinstance(go, ReadGo)
    net.run_until(write_at + write_for + 1.0)
    assert net.freed_leases() == [(write_at + write_for, ticket.lease, "DONE")]
    assert net.fenced == []
    assert [rid for _, _, rid in net.confirmed] == ["r1"]
