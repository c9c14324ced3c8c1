"""The chaos run's schedule through the simulator, and the two histories compared.

The simulator (the real kvproto core over the loopback network, spec/simulator.md)
gets the run's cluster (two prefill engines, one decoder, TP 1), its lease
settings, its request rate, and its faults at the times the run applied them:
a kill and the restart at the moment the real engine was healthy again, a cut
and its heal, a loss and its end, each link-down of a flap as a cut of that
host from its fabric peers. Its requests wait on the decoder as long as the
real run's leases lived on average away from the faults (Little's law over the
samples out of every fault's reach: mean leases on P over the request rate),
so about as many leases are live when a fault comes.

They are compared where they model the same thing:

* a decoder killed: the leases it had claimed are freed ``PEER_LOST``, in both,
  within the detection bound (the simulator reports the loss after the NIXL
  transport's declared detection bound, the real run measures its own);
* a partition past the lease: what the cut-off decoder held on that prefill
  engine is freed by expiry, in both, no sooner than ``e - i`` and no later than
  ``d`` after the cut (plus one pump gap and one scrape in the real run);
* the simulator's own oracles (safety S1-S4, liveness L1-L3) hold on the schedule.

Not compared, and said so in the report: what TCP does after a heal (the model's
network heals at once; spec/fault-testing.md), client hang-ups and router errors
(the model has neither), and a prefill engine's kill (its leases vanish with it
in both; nothing to time).
"""

from __future__ import annotations

from collections import Counter
from statistics import fmean

from kvproto.config import LeaseConfig
from kvproto_tools.chaos.bounds import PLANNING_TERMS, lease_timing, settle_s
from kvproto_tools.chaos.checker import Reclaim, Verdict, Violation
from kvproto_tools.chaos.history import History, Injected
from kvproto_tools.chaos.schedule import DECODE, PREFILLS
from kvproto_tools.chaos.series import leases
from kvproto_tools.sim.clock import StepModel
from kvproto_tools.sim.engine import Simulator
from kvproto_tools.sim.model import Hold
from kvproto_tools.sim.policies import MAX_NOTIFICATION, kvproto_policy
from kvproto_tools.sim.scenarios import EngineSpec, FaultEvent, QueueWait, Scenario
from kvproto_transports.nixl.transport import PROBE_DETECTION_SLACK_S
from kvproto_vllm.config import DEFAULT_PROBE_INTERVAL_S

SIM_NAME = {"prefill-0": "P0", "prefill-1": "P1", "decode-0": "D0"}
"""The run's engines as the simulator names them."""
DETECTION_S = DEFAULT_PROBE_INTERVAL_S + PROBE_DETECTION_SLACK_S
"""When the simulated transport reports a dead peer: the NIXL transport's declared bound
at the adapter's probe interval."""
SIM_STEP_S = 0.02
"""The simulated decoder's step (the tiny model's decode steps are milliseconds)."""


def _events(done: Injected) -> list[FaultEvent]:
    """The simulator's timeline for one applied fault."""
    f = done.fault
    names = tuple(SIM_NAME[n] for n in f.target)
    if f.kind.startswith("kill"):
        return [
            FaultEvent(at=done.start, action="kill", engines=names),
            FaultEvent(at=done.end, action="restart", engines=names),
        ]
    if f.kind == "partition":
        return [
            FaultEvent(at=done.start, action="cut", engines=names),
            FaultEvent(at=done.end, action="heal", engines=names),
        ]
    if f.kind == "loss":
        return [
            FaultEvent(at=done.start, action="loss", engines=names, drop=f.loss),
            FaultEvent(at=done.end, action="lossless", engines=names),
        ]
    (host,) = names
    peers = [SIM_NAME[p] for p in PREFILLS] if f.target == (DECODE,) else [SIM_NAME[DECODE]]
    out = []
    for k in range(f.flaps):
        down = done.start + k * (f.down_s + f.up_s)
        for peer in peers:
            out += [
                FaultEvent(at=down, action="cut", engines=(host, peer)),
                FaultEvent(at=down + f.down_s, action="heal", engines=(host, peer)),
            ]
    return out


def scenario(history: History) -> Scenario:
    """The run's cluster, load and applied faults as a simulator scenario."""
    lease_s = history.plan.lease_s
    reach = [
        (d.start, d.end + settle_s(d.fault, lease_s, PLANNING_TERMS)) for d in history.injected
    ]
    steady = [
        leases(s)
        for s in history.samples
        if s.t1 <= history.load_end and not any(a <= s.t1 and s.t0 <= b for a, b in reach)
    ]
    wait = max(SIM_STEP_S, (fmean(steady) if steady else 0.0) / history.rate)
    return Scenario(
        name="chaos",
        summary=f"the chaos run of seed {history.plan.seed}, its faults at their real times",
        headline="reclaim_s",
        arrival_rate=history.rate,
        arrival_window=history.plan.duration_s,
        prompt_tokens=(64, 192),
        output_tokens=(4, 16),
        queue_wait=QueueWait(kind="exp", a=wait, b=20.0 * wait),
        d_steps=StepModel(step=SIM_STEP_S),
        detection_delay=DETECTION_S,
        cluster=(
            EngineSpec(name="P0", role="P", tp=1),
            EngineSpec(name="P1", role="P", tp=1),
            EngineSpec(name="D0", role="D", tp=1),
        ),
        events=tuple(e for done in history.injected for e in _events(done)),
    )


def _live_at(holds: list[Hold], t: float, engines: tuple[str, ...]) -> list[Hold]:
    """Holds of ``engines`` for the decoder that were live at ``t``."""
    return [
        h
        for h in holds
        if h.engine.name in engines
        and h.granted_at <= t
        and (h.ended_at is None or h.ended_at > t)
        and h.req is not None
        and h.req.reader is not None
        and h.req.reader.name == "D0"
    ]


def compare(history: History, verdict: Verdict) -> tuple[list[str], list[Violation]]:
    """Run the simulator on the run's schedule; report lines, and what disagrees."""
    lease = lease_timing(history.plan.lease_s)
    sim = Simulator(
        scenario(history),
        kvproto_policy(
            LeaseConfig(
                kv_lease_duration=lease.kv_lease_duration, max_notification_size=MAX_NOTIFICATION
            ),
            name=f"kvproto-{history.plan.lease_s}s",
            summary="kvproto with the chaos run's leases",
        ),
        seed=history.plan.seed,
        liveness=True,
        hold_log=True,
    )
    result = sim.run()
    holds = sim.books.ended or []
    lines = [
        f"{result.extra['requests']} requests at {history.rate:g}/s, "
        f"{len(history.injected)} faults at the run's times; decoder queue wait mean "
        f"{sim.scenario.queue_wait.a:.2f} s (the run's mean lease life away from faults); loss "
        f"reported {DETECTION_S:.2f} s after a death; safety violations "
        f"{len(result.violations)}, liveness {result.liveness_violations}",
    ]
    violations = [
        Violation(check="simulator", t=v.time, detail=f"the simulator's {v.kind}: {v.detail}")
        for v in (*result.violations, *result.liveness)
    ]
    real_ends = Counter(verdict.ended)
    sim_ends = Counter(h.end_reason for h in holds if h.engine.name in ("P0", "P1"))
    lines.append(
        "leases by end: real "
        + ", ".join(f"{k} {v}" for k, v in real_ends.items() if v)
        + "; simulated "
        + ", ".join(f"{k} {v}" for k, v in sorted(sim_ends.items()))
    )
    by_index = {r.fault: r for r in verdict.reclaims}
    for done in history.injected:
        real = by_index.get(done.fault.index)
        line, problem = _one(done, real, holds, lease)
        if line:
            lines.append(line)
        if problem:
            violations.append(Violation(check="simulator", t=done.start, detail=problem))
    lines.append(
        "not compared: TCP's wait after a heal (the model heals at once), client hang-ups and "
        "router errors (not modelled), a prefill engine's kill (its leases vanish in both)"
    )
    return lines, violations


def _one(
    done: Injected, real: Reclaim | None, holds: list[Hold], lease: LeaseConfig
) -> tuple[str, str]:
    """One fault's comparison: (report line, disagreement or "")."""
    f = done.fault
    if real is None or f.kind not in ("kill-decode", "partition"):
        return "", ""
    if real.freed_s is None or real.freed_bound_s is None:
        if f.kind == "partition" and f.length_s < lease.kv_lease_duration:
            return "", ""
        return f"fault {f.index} {f.kind}: real: no lease claimed as it began, not compared", ""
    engines: tuple[str, ...] = ("P0", "P1")
    reason = "peer-lost"
    if f.kind != "kill-decode":
        engines, reason = (SIM_NAME[f.target[0]],), "expired"
    live = _live_at(holds, done.start, engines)
    ended = Counter(h.end_reason for h in live)
    freed = [h.ended_at - done.start for h in live if h.end_reason == reason and h.ended_at]
    head = (
        f"fault {f.index} {f.kind}: real freed {real.freed_s:.2f} s "
        f"(bound {real.freed_bound_s:.2f} s)"
    )
    if not freed:
        return f"{head}; simulated: no lease of that kind live at the fault ({dict(ended)})", ""
    sim_freed = max(freed)
    line = f"{head}; simulated {sim_freed:.2f} s by {reason} ({dict(ended)})"
    if f.kind == "kill-decode":
        bound = DETECTION_S + SIM_STEP_S
        if sim_freed > bound:
            return (
                line,
                f"fault {f.index}: the simulator freed after {sim_freed:.2f} s, "
                f"bound {bound:.2f} s",
            )
        return line, ""
    # Held across the cut: freed at max(t_last + e, grant + d), t_last within i of the cut.
    low = lease.lease_extension - lease.heartbeat_interval - SIM_STEP_S
    high = real.freed_bound_s
    if not low <= sim_freed <= high:
        return line, (
            f"fault {f.index}: the simulator freed the cut-off leases {sim_freed:.2f} s after "
            f"the cut, outside [{low:.2f}, {high:.2f}] s"
        )
    return line, ""
