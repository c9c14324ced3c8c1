"""Split invariance: one batch equals the same changes item by item, and a notification
cap (uccl's 256 bytes) changes frame count, never outcome."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto import wire
from kvproto.config import LeaseConfig
from kvproto.holder import Holder
from kvproto.states import ReadState
from kvproto.ticket import LeaseTicket, claim_proof

from .net import Net
from .pair import counter_entropy
from .rawsession import open_session

READER_ENGINE = "D"


def holder_with_leases(n: int) -> tuple[Holder, list[LeaseTicket], bytes]:
    h = Holder(LeaseConfig(), engine="P", incarnation=7, entropy=counter_entropy(5))
    tickets = [h.grant(0.0, request_id=f"p{i}") for i in range(n)]
    anchor = h.grant(0.0, request_id="anchor")  # keys the session; never claimed
    key = open_session(h, anchor, "D0", engine=READER_ENGINE)
    assert key is not None
    return h, tickets, key


def claim(t: LeaseTicket) -> wire.Claim:
    return wire.Claim(lease=t.lease, proof=claim_proof(t.token, READER_ENGINE, t.lease))


def holder_view(h: Holder, tickets: list[LeaseTicket]) -> dict[str, Any]:
    stats = h.stats_snapshot()
    return {
        "states": [h.lease_state(t.lease) for t in tickets],
        "deadlines": [
            None if h.lease_state(t.lease).terminal else h.deadline(t.lease)  # type: ignore[union-attr]
            for t in tickets
        ],
        "stats": {k: v for k, v in stats.items() if k not in ("heartbeats",)},
    }


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 25),
    order=st.randoms(use_true_random=False),
    when=st.floats(0.0, 29.0),
    claimed=st.data(),
)
def test_one_heartbeat_with_n_claims_equals_n_heartbeats_with_one(
    n: int, order: Any, when: float, claimed: st.DataObject
) -> None:
    picks = claimed.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
    batch_holder, tickets, key = holder_with_leases(n)
    single_holder, tickets2, key2 = holder_with_leases(n)
    assert key == key2
    assert [t.token for t in tickets] == [t.token for t in tickets2]
    chosen = [tickets[i] for i in picks]
    order.shuffle(chosen)
    ids = [t.lease for t in chosen]
    batch = wire.Heartbeat(
        seq=1, claims=[claim(t) for t in chosen], aborts=[], count=len(ids), digest=wire.digest(ids)
    )
    batch_holder.handle_frame(when, "D0", wire.encode(batch, key))
    for i, t in enumerate(chosen, start=1):
        hb = wire.Heartbeat(
            seq=i, claims=[claim(t)], aborts=[], count=i, digest=wire.digest(ids[:i])
        )
        single_holder.handle_frame(when, "D0", wire.encode(hb, key))
    a, b = holder_view(batch_holder, tickets), holder_view(single_holder, tickets2)
    assert a == b
    assert a["stats"]["claims"] == len(ids) and a["stats"]["resyncs"] == 0
    # The acks carry the same per-lease answers.
    held_a = sorted(
        x
        for o in batch_holder.drain()
        for x in wire.decode(o.payload).held  # type: ignore[union-attr]
    )
    held_b = sorted(
        x
        for o in single_holder.drain()
        for x in wire.decode(o.payload).held  # type: ignore[union-attr]
    )
    assert held_a == held_b and len(held_a) == len(ids)
    # Both go on renewing every claimed lease from then on, and expire the rest on time.
    for h in (batch_holder, single_holder):
        h.handle_timer(35.0)
    assert holder_view(batch_holder, tickets) == holder_view(single_holder, tickets2)


def run_workload(cap: int | None, seed: int, bursts: list[int]) -> Net:
    net = Net(LeaseConfig(max_notification_size=cap), seed=seed)
    net.add_holder("P0")
    net.add_reader("D0")
    k = 0
    ended: set[str] = set()
    for tick, burst in enumerate(bursts):
        net.run_until(1.0 + 2.5 * tick)
        for _ in range(burst):
            ticket = net.grant("P0", f"p{k}")
            net.track("D0", f"r{k}", ticket)
            k += 1
        # Requests end (read, or abort) in a fixed pattern so that both runs match.
        r = net.reader("D0")
        for j in range(0, k, 7):
            rid = f"r{j}"
            if rid in ended or not r.ready_to_read(rid):
                continue
            if ReadState.FAILED in r.state(rid).values():
                continue
            ended.add(rid)
            if j % 2:
                net.start_read("D0", rid)
            else:
                net.finish("D0", rid)
    net.run_until(200.0)
    return net


def final_view(net: Net) -> dict[str, Any]:
    h = net.holder("P0")
    return {
        "freed": sorted((lease, reason) for _, lease, reason in net.freed_leases()),
        "failed": sorted(net.failures()),
        "confirmed": sorted(rid for _, _, rid in net.confirmed),
        "live": h.live_leases(),
    }


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 1000),
    bursts=st.lists(st.integers(0, 30), min_size=1, max_size=12),
)
def test_notification_cap_changes_frames_never_outcome(seed: int, bursts: list[int]) -> None:
    capped = run_workload(256, seed, bursts)
    free = run_workload(None, seed, bursts)
    assert all(len(p) <= 256 for _, _, _, p in capped.sent)
    assert final_view(capped) == final_view(free)
    # Not a single request was lost to the splitting (uccl #1015 lost them all).
    assert all(reason != "LEASE_LOST" for _, _, reason in capped.failures())


def test_split_heartbeat_size_stays_flat_under_steady_arrivals() -> None:
    """8 new requests per tick with a 256-byte cap: bytes per tick stay flat, not
    proportional to the ~100 leases in flight (each tick re-claimed every lease before)."""
    net = Net(LeaseConfig(max_notification_size=256))
    net.add_holder("P0")
    net.add_reader("D0")
    k = 0
    for tick in range(12):
        net.run_until(tick * 5.0 + 1)
        for _ in range(8):
            net.track("D0", f"r{k}", net.grant("P0", f"p{k}"))
            k += 1
    net.run_until(60.0)
    per_tick: dict[float, int] = {}
    for t, src, _, payload in net.sent:
        if src == "D0":
            per_tick[t] = per_tick.get(t, 0) + len(payload)
    steady = [v for t, v in per_tick.items() if t >= 11.0]
    assert max(steady) <= 8 * 28 + 2 * 30, per_tick  # 8 claims plus frame headers
    assert net.holder("P0").stats.resyncs == 0
    assert net.failures() == []


def test_resync_with_new_claims_in_later_frames_loses_nothing() -> None:
    """A resync list sent while fresh claims spill into later frames must not name
    them before their claims: the holder would answer "lost" and the requests fail."""
    net = Net(LeaseConfig(max_notification_size=256))
    net.add_holder("P0")
    net.add_reader("D0")
    for at, count, base in [(1.0, 8, 0), (3.0, 13, 8)]:
        net.run_until(at)
        for i in range(base, base + count):
            net.track("D0", f"r{i}", net.grant("P0", f"p{i}"))
    net.reader("D0")._sessions[("P", 0)].beats.want_full = True  # as after any divergence
    net.run_until(30.0)
    assert net.failures() == []
    assert net.holder("P0").live_leases() == 21
    assert all(len(p) <= 256 for _, _, _, p in net.sent)


def test_steady_state_keepalive_costs_under_two_bytes_per_lease() -> None:
    net = Net()
    net.add_holder("P0")
    net.add_reader("D0")
    for i in range(1000):
        net.track("D0", f"r{i}", net.grant("P0", f"p{i}"))
    net.run_until(6.0)
    before = net.reader("D0").stats.heartbeat_bytes
    net.run_until(26.0)
    beats = net.reader("D0").stats.heartbeat_bytes - before
    assert beats / 4 / 1000 <= 2  # four keep-alives renewing 1000 leases each
    assert net.holder("P0").live_leases() == 1000
