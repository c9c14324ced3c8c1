"""The discrete-event simulator: engines, workload, faults and oracles over the loopback network.

One global virtual time. Two event sources are merged in time order: the
loopback network's own queue (frames, read completions, loss reports) and the
simulator's heap (arrivals, step boundaries, faults, handshakes, oracle
deadlines). Engines act only at their step boundaries (:mod:`.clock`); what
the network delivers in between waits in the rank's inbox, as in vLLM's step
loop. spec/simulator.md describes the model and every figure.
"""

from __future__ import annotations

import functools
import gc
import heapq
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvproto.transport import PeerId, ReadCompleted, ReadFailed, ReadId, TransportEvent
from kvproto_tools.sim import checks, faults, flows, handshake
from kvproto_tools.sim.clock import NodeClock, StepClock
from kvproto_tools.sim.memory import BlockPool, block_len
from kvproto_tools.sim.model import Hold, Metrics, ReadRec, Req, ReqState
from kvproto_tools.sim.oracles import Recorder, Violation
from kvproto_tools.sim.policies import MAX_NOTIFICATION, POLICIES, Policy
from kvproto_tools.sim.scenarios import CLUSTER, SCENARIOS, EngineSpec, Scenario
from kvproto_tools.sim.sides import HandshakeAsk, Side
from kvproto_tools.sim.transport import SimTransport
from kvproto_tools.sim.workload import Arrival, generate
from kvproto_transports.loopback import LoopbackNetwork


class SimError(RuntimeError):
    """The simulator itself went wrong (not a protocol violation)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Model constants shared by every scenario (spec/simulator.md explains each)."""

    pool_blocks: int = 16_384
    """KV blocks per engine."""
    proxy_delay: float = 0.005
    """Routing proxy hop from P to D (and client to P), seconds."""
    prefill_base: float = 0.01
    """Fixed part of a prefill step, seconds."""
    prefill_per_token: float = 40e-6
    """Prefill time per prompt token, seconds."""
    read_bandwidth: float = 800_000.0
    """Simulated bytes per second a read moves (64 B blocks stand for ~2 MiB at 25 GB/s)."""
    handshake_cost: float = 0.002
    """Side-channel handshake processing on top of one round trip, seconds."""
    handshake_timeout: float = 5.0
    """A handshake to a dead or unreachable holder fails after this (vLLM's RCVTIMEO)."""
    rank_skew: float = 0.005
    """A TP worker issues its read up to this long after the step boundary, seconds."""
    cap: float = 4000.0
    """Hard stop of a run, simulated seconds."""


class EngineState:
    """One engine (all its ranks) and its current incarnation."""

    def __init__(self, sim: Simulator, spec: EngineSpec, clock: NodeClock) -> None:
        self.sim = sim
        self.spec = spec
        self.name = spec.name
        self.role = spec.role
        self.tp = spec.tp
        self.clock = clock
        self.incarnation = 0
        self.alive = False
        self.steps: StepClock | None = None
        self.max_step = 0.0
        self.transports: list[SimTransport] = []
        self.side: Side
        self.pool = BlockPool(1)
        self.holds: dict[str, Hold] = {}
        self.next_wake: float | None = None
        self.last_wake = -1.0
        self.wakes_at_last = 0
        # prefill (P role)
        self.queue: deque[Arrival] = deque()
        self.current: tuple[Arrival, list[int]] | None = None
        self.busy_until: float | None = None
        # reader role
        self.arrivals: list[Req] = []
        self.waiting: list[Req] = []
        self.hs_results: list[tuple[HandshakeAsk, dict[int, bytes] | None, float]] = []
        self.hs_busy: dict[int, float] = {}

    def boundary(self, t: float) -> float:
        """The first step boundary at or after ``t`` (P: the end of the running prefill)."""
        if self.steps is not None:
            return self.steps.boundary(t)
        if self.busy_until is not None and t < self.busy_until:
            return self.busy_until
        return t

    def __repr__(self) -> str:
        return f"<{self.name}.{self.incarnation}>"


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """Everything one run produced."""

    scenario: str
    """Scenario name."""
    policy: str
    """Policy name."""
    seed: int
    """The seed; the same seed replays the same run."""
    metrics: dict[str, float | int | None]
    """The figures (JSON ``metrics``)."""
    violations: tuple[Violation, ...] = ()
    """Safety violations (the first few carry a trace)."""
    liveness: tuple[Violation, ...] = ()
    """Liveness violations (only checked with ``liveness=True``)."""
    liveness_violations: int = 0
    """How many liveness checks failed."""
    extra: dict[str, float | int] = field(default_factory=dict)
    """Further counters for people (requests, recomputed, corrupted bytes, events...)."""
    timeline: tuple[tuple[float, int], ...] = ()
    """(time, blocks held by holders) at every change, if recorded."""
    wall_s: float = 0.0
    """Wall-clock seconds the run took."""

    def to_json(self) -> dict[str, object]:
        """One entry of the JSON ``runs`` list."""
        return {
            "scenario": self.scenario,
            "policy": self.policy,
            "seed": self.seed,
            "metrics": dict(self.metrics),
        }


class Simulator:
    """One run: a scenario, a policy, a seed."""

    def __init__(
        self,
        scenario: Scenario | str,
        policy: Policy | str,
        seed: int,
        *,
        liveness: bool = False,
        timeline: bool = False,
        settings: Settings | None = None,
    ) -> None:
        self.scenario = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
        self.policy = POLICIES[policy] if isinstance(policy, str) else policy
        self.seed = seed
        self.liveness = liveness
        self.settings = settings or Settings()
        self.base = f"kvproto-sim/{self.scenario.name}/{seed}"
        sc = self.scenario
        self.net = LoopbackNetwork(
            seed=seed,
            detection_delay=sc.detection_delay,
            read_bandwidth=self.settings.read_bandwidth,
            default_link=sc.link,
        )
        self.t = 0.0
        self.metrics = Metrics()
        self.rec = Recorder()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.engines: dict[str, EngineState] = {}
        self.prefill: list[EngineState] = []
        self.decode: list[EngineState] = []
        self.peer_owner: dict[PeerId, tuple[EngineState, int]] = {}
        self.reads: dict[tuple[PeerId, ReadId], ReadRec] = {}
        self.reqs: dict[str, Req] = {}
        self.last_hb: dict[tuple[str, int, int, str], float] = {}
        self.live_transports: list[SimTransport] = []
        self.held_blocks = 0
        self.open_holds = 0
        self.open_requests = 0
        self.faults_pending = 0
        self.crash_holds: list[Hold] = []
        self.crash_time: float | None = None
        self.record_timeline = timeline
        self.timeline: list[tuple[float, int]] = [(0.0, 0)]
        self.events = 0
        self.extra: dict[str, float | int] = {
            "requests": 0,
            "used": 0,
            "recomputed": 0,
            "corrupted": 0,
            "lost": 0,
            "turn2": 0,
            "handshakes": 0,
            "handshakes_failed": 0,
        }
        max_prefill = self.prefill_time(sc.prompt_tokens[1])
        for spec in CLUSTER:
            eng = EngineState(self, spec, sc.clocks.get(spec.name, NodeClock()))
            if spec.role == "D":
                eng.steps = StepClock(sc.d_steps, random.Random(f"{self.base}/steps/{spec.name}"))
                eng.max_step = sc.d_steps.max_step
                self.decode.append(eng)
            else:
                eng.max_step = max_prefill
                self.prefill.append(eng)
            self.engines[spec.name] = eng
            self.start_engine(eng)
        rng = random.Random(f"{self.base}/workload")
        self.arrivals = generate(sc, rng, len(self.prefill), len(self.decode))
        self.fault_rng = random.Random(f"{self.base}/faults")

    def at(self, t: float, fire: Callable[[], None]) -> None:
        """Run ``fire`` at global time ``t``."""
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fire))

    def note(self, text: str) -> None:
        """Add an event to the trace ring."""
        self.rec.note(self.t, text)

    def violate(self, mode: str, kind: str, detail: str) -> None:
        """Record a failed oracle."""
        if mode == "safety":
            self.metrics.safety_violations += 1
        self.rec.violate(mode, kind, self.t, detail)

    def prefill_time(self, tokens: int) -> float:
        """Seconds one prefill step takes for ``tokens`` prompt tokens."""
        return self.settings.prefill_base + tokens * self.settings.prefill_per_token

    def start_engine(self, eng: EngineState) -> None:
        """Bring up the next incarnation of ``eng``: endpoints, memory, lease side."""
        eng.incarnation += 1
        eng.alive = True
        eng.transports = []
        eng.pool = BlockPool(self.settings.pool_blocks)
        for rank in range(eng.tp):
            name = f"{eng.name}r{rank}"
            if eng.incarnation == 1:
                real = self.net.endpoint(name, max_notification_size=MAX_NOTIFICATION)
            else:
                real = self.net.restart(name)
            layout = real.allocate_layout(1, block_len(eng.tp), self.settings.pool_blocks)
            real.register_blocks(layout)
            tr = SimTransport(self, eng, rank, real)
            eng.transports.append(tr)
            self.live_transports.append(tr)
            self.peer_owner[real.local_peer] = (eng, rank)
        if eng.incarnation > 1:
            self._count(eng.side)  # the dead incarnation's counters
        eng.side = self.policy.make(
            eng.transports, eng.name, eng.incarnation, f"{self.base}/{eng.name}.{eng.incarnation}"
        )

    def request_wake(self, eng: EngineState, t: float) -> None:
        """Make ``eng`` step at its first boundary at or after ``t``."""
        if not eng.alive:
            return
        b = eng.boundary(max(t, self.t))
        if eng.next_wake is not None and eng.next_wake <= b:
            return
        eng.next_wake = b

        def fire() -> None:
            if eng.next_wake == b and eng.alive:
                eng.next_wake = None
                self._wake(eng)

        self.at(b, fire)

    def _collect(self) -> None:
        """Take what the network delivered, note read copies, wake the receiving engines."""
        for tr in self.live_transports:
            if tr.real.alive:
                events = tr.take_network_events()
                if events:
                    self.network_events(tr, events)

    def network_events(self, tr: SimTransport, events: list[TransportEvent]) -> None:
        """Events for ``tr``'s rank: note read copies, queue them, wake the engine."""
        for ev in events:
            if isinstance(ev, ReadCompleted):
                flows.copied(self, tr, ev.read_id)
            elif isinstance(ev, ReadFailed):
                self.reads.pop((tr.real.local_peer, ev.read_id), None)
        tr.inbox.extend(events)
        self.request_wake(tr.engine, self.t)

    def run(self) -> RunResult:
        """Simulate until every request is resolved and every hold ended (or the cap)."""
        started = time.perf_counter()
        # A run allocates many short-lived objects and few cycles: collecting
        # the young generation less often saves about a third of the time.
        thresholds = gc.get_threshold()
        gc.set_threshold(50_000, 20, 20)
        # The binding logs every failed read and lost peer; faults are this
        # simulator's job, so only errors are let through while it runs.
        binding_log = logging.getLogger("kvproto.binding")
        level = binding_log.level
        binding_log.setLevel(logging.ERROR)
        try:
            return self._run(started)
        finally:
            gc.set_threshold(*thresholds)
            binding_log.setLevel(level)

    def _run(self, started: float) -> RunResult:
        """The event loop: merge the network's queue and ours, in time order."""
        sc = self.scenario
        for a in self.arrivals:
            self.open_requests += 1
            self.extra["requests"] += 1
            self.at(a.at, functools.partial(flows.prefill_arrival, self, a))
        faults.schedule_faults(self, sc)
        cap = self.settings.cap
        net = self.net
        heap = self._heap
        while True:
            tn = net.next_event_time()
            tm = heap[0][0] if heap else math.inf
            tn_ = math.inf if tn is None else tn
            if tn_ <= tm:
                if tn_ > cap:
                    break
                self.t = tn_
                net.advance(tn_)
            else:
                if tm > cap:
                    break
                _, _, fire = heapq.heappop(heap)
                self.t = tm
                net.advance(tm)
                fire()
            self._collect()
            self.events += 1
            if self.open_requests == 0 and self.open_holds == 0 and self.faults_pending == 0:
                break
        return self._finish(time.perf_counter() - started)

    def _finish(self, wall: float) -> RunResult:
        """Close the books: open holds, reclaim time, the result."""
        end = self.t
        for eng in self.engines.values():
            for hold in list(eng.holds.values()):
                if self.liveness:
                    self.violate(
                        "liveness",
                        "L3 leak",
                        f"{eng.name} still holds {hold.key[:18]} at the end of the run",
                    )
                if hold.dead_since is not None:
                    self.metrics.dead_block_seconds += hold.nblocks * (end - hold.dead_since)
        if self.crash_time is not None:
            ends = [h.ended_at if h.ended_at is not None else end for h in self.crash_holds]
            self.metrics.reclaim_s = max(ends, default=self.crash_time) - self.crash_time
        for eng in self.engines.values():
            self._count(eng.side)
        self.extra["events"] = self.events
        self.extra["end_s"] = round(end, 3)
        self.extra["liveness_violations"] = self.rec.liveness_count
        return RunResult(
            scenario=self.scenario.name,
            policy=self.policy.name,
            seed=self.seed,
            metrics=self.metrics.as_dict(),
            violations=tuple(self.rec.safety),
            liveness=tuple(self.rec.liveness),
            liveness_violations=self.rec.liveness_count,
            extra=dict(self.extra),
            timeline=tuple(self.timeline) if self.record_timeline else (),
            wall_s=wall,
        )

    def _count(self, side: Side) -> None:
        """Add a side's own counters (vLLM's ``nixl_num_*``) to ``extra``."""
        for key, value in side.counters().items():
            self.extra[key] = self.extra.get(key, 0) + value

    def _wake(self, eng: EngineState) -> None:
        """One step boundary of ``eng``: handshakes, frames, timers, work, oracles."""
        t = self.t
        if t == eng.last_wake:
            eng.wakes_at_last += 1
            if eng.wakes_at_last > 1000:
                raise SimError(f"{eng.name} woke 1000 times at t={t}: a timer never clears")
        else:
            eng.last_wake, eng.wakes_at_last = t, 0
        now = eng.clock.local(t)
        side = eng.side
        results, eng.hs_results = eng.hs_results, []
        for ask, meta, offset in results:
            if meta is None:
                side.connect_failed(now, ask)
            else:
                side.connected(now, ask, meta, offset)
        side.step(now)
        self.effects(eng)
        if eng.role == "P":
            flows.prefill_work(self, eng, now)
        flows.reader_work(self, eng, now)
        side.step(now)
        self.effects(eng)
        checks.holder_oracles(self, eng)
        timer = side.next_timer()
        if timer is not None:
            self.request_wake(eng, eng.clock.to_global(timer) if timer > -math.inf else t)

    def effects(self, eng: EngineState) -> None:
        """Act on everything the side reported, until it is quiet."""
        side = eng.side
        while fx := side.take():
            for rank, key, reason in fx.freed:
                flows.rank_freed(self, eng, rank, key, reason)
            for key, reason in fx.failed:
                req = self.reqs.get(key)
                if req is not None and req.reader is eng and req.state.waiting_for_blocks:
                    flows.fail(self, req, reason)
            for key, rank in fx.usable:
                req = self.reqs.get(key)
                # TRACKED too: a rank's read may be confirmed while another rank's is
                # still deferred; the request is used once every rank is.
                live = (ReqState.TRACKED, ReqState.READING)
                if req is not None and req.reader is eng and req.state in live:
                    req.ranks_ok.add(rank)
                    if len(req.ranks_ok) == eng.tp and req.state is ReqState.READING:
                        flows.use(self, req)
            for ask in fx.asks:
                handshake.handshake(self, eng, ask)

    def read_issued(self, tr: SimTransport, read_id: ReadId, peer: PeerId, req: Req) -> None:
        """A side issued a read through ``tr`` for ``req``."""
        holder, holder_rank = self.peer_owner[peer]
        rec = ReadRec(
            req=req, reader_rank=tr.rank, holder=holder, holder_rank=holder_rank, issued_at=self.t
        )
        req.reads.append(rec)
        self.reads[(tr.real.local_peer, read_id)] = rec

    def heartbeat_seen(self, eng: EngineState, rank: int, peer: PeerId) -> None:
        """A holder rank is about to process a heartbeat from ``peer`` (liveness bound L1)."""
        owner = self.peer_owner.get(peer)
        if owner is not None:
            self.last_hb[(eng.name, eng.incarnation, rank, owner[0].name)] = eng.clock.local(self.t)


def run(
    scenario: str, policy: str, seed: int, *, liveness: bool = False, timeline: bool = False
) -> RunResult:
    """Run one simulation."""
    return Simulator(scenario, policy, seed, liveness=liveness, timeline=timeline).run()
