"""The simulator under the schedule of the real long-partition run: what it predicts.

The real run (test_lease_faults.py, partition longer than the extension):
6 s leases (i = 1 s, e = 4 s), leases granted ~1.2 s before the cut, a
7 s partition (e + 3 i), heal. Here the simulator (the real core over its
loopback network) runs that schedule between D1 and P1 with the same lease
configuration, and every lease P1 held for D1 across the cut is compared
with the spec's rule, which the real run's reclaim meets too:
``freed at max(t_last + e, grant + w)`` (spec/timing.md), within one holder
step. What the simulator does not model is printed beside it: its network
heals at once, a TCP connection does not (spec/fault-testing.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvproto.config import LeaseConfig
from kvproto_tools.sim import engine
from kvproto_tools.sim.policies import MAX_NOTIFICATION, kvproto_policy
from kvproto_tools.sim.scenarios import QueueWait, Scenario

from .world import CONFIG

CUT, LENGTH = 40.0, 7.0
STEP_TOLERANCE_S = 0.1
"""One holder step of the simulated engines (prefill steps of up to ~0.09 s) plus a link delay."""


@dataclass
class _End:
    holder: str
    granted: float
    ended: float
    reason: str
    reader: str


def test_simulated_partition_reclaims_where_the_rule_says() -> None:
    cfg = LeaseConfig(**CONFIG, max_notification_size=MAX_NOTIFICATION)
    scenario = Scenario(
        name="netfault-partition",
        summary=f"D1 cut off from P1 for {LENGTH:g} s at {CUT:g} s (6 s leases), then healed",
        headline="premature_frees",
        arrival_rate=3.0,
        arrival_window=60.0,
        queue_wait=QueueWait(kind="uniform", a=2.0, b=12.0),
        partition=("D1", "P1", CUT, (LENGTH, LENGTH)),
    )
    sim = engine.Simulator(
        scenario,
        kvproto_policy(
            cfg, name="kvproto-6s", summary="kvproto with the network-fault tests' 6 s leases"
        ),
        seed=0,
        liveness=True,
        hold_log=True,
    )
    result = sim.run()
    assert sim.books.ended is not None
    ends = [
        _End(
            h.engine.name,
            h.granted_at,
            h.ended_at if h.ended_at is not None else float("inf"),
            h.end_reason,
            h.req.reader.name if h.req is not None and h.req.reader else "",
        )
        for h in sim.books.ended
    ]
    assert result.metrics["safety_violations"] == 0 and result.metrics["overlapped_reads"] == 0

    heal = CUT + LENGTH
    across = [
        e for e in ends if e.reader == "D1" and e.granted < CUT < e.ended and e.holder == "P1"
    ]
    assert across, "no lease of P1 for D1 was held across the cut"
    # Every lease held across a cut longer than e ends by expiry, never later than the rule.
    assert {e.reason for e in across} == {"expired"}
    for e in across:
        bound = max(cfg.lease_extension, e.granted + cfg.grant_ttl - CUT)
        assert e.ended - CUT <= bound + STEP_TOLERANCE_S, (e, bound)
    # The real run's leases were granted 1-2 s before the cut (two heartbeats seen).
    like_real = [e for e in across if 1.0 <= CUT - e.granted <= 2.0]
    after = [e for e in ends if e.reader == "D1" and e.granted > heal and e.holder == "P1"]
    served_after = sorted(
        e.ended
        for e in ends
        if e.reader == "D1" and e.holder == "P1" and e.ended > heal and e.reason == "done"
    )
    lost_after = [e for e in after if e.reason != "done"]
    reclaims = sorted(round(e.ended - CUT, 2) for e in like_real)
    print(
        f"\nsimulator, {LENGTH:g} s partition D1-P1 with 6 s leases: {len(across)} leases held "
        f"across the cut, all freed by expiry (premature {result.metrics['premature_frees']}); "
        f"reclaim after the cut of those granted 1-2 s before it: {reclaims} s "
        f"(rule: max(e, grant + w - cut)); D1's first read of P1 after the heal done "
        f"{(served_after[0] - heal) if served_after else float('nan'):.2f} s after it, "
        f"{len(lost_after)} of {len(after)} leases granted after the heal not freed by done"
    )
    assert lost_after == []  # the model's network heals at once (the real TCP does not)
