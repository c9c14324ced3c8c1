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
import logging
import math
import random
import time
from dataclasses import dataclass, field

from kvproto.transport import PeerId, ReadCompleted, ReadFailed, ReadId, TransportEvent
from kvproto_tools.sim import checks, faults, flows, handshake
from kvproto_tools.sim.agenda import Agenda
from kvproto_tools.sim.books import Books
from kvproto_tools.sim.clock import NodeClock, StepClock
from kvproto_tools.sim.cluster import Cluster
from kvproto_tools.sim.context import Context
from kvproto_tools.sim.fabric import Fabric
from kvproto_tools.sim.memory import BlockPool, block_len
from kvproto_tools.sim.model import EngineState, ReadRec, Req, ReqState
from kvproto_tools.sim.oracles import Violation
from kvproto_tools.sim.policies import MAX_NOTIFICATION, POLICIES, Policy
from kvproto_tools.sim.scenarios import SCENARIOS, Scenario
from kvproto_tools.sim.settings import Settings
from kvproto_tools.sim.sides import Side
from kvproto_tools.sim.transport import SimTransport
from kvproto_tools.sim.workload import generate
from kvproto_transports.loopback import LoopbackNetwork


class SimError(RuntimeError):
    """The simulator itself went wrong (not a protocol violation)."""


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
    """One run: a scenario, a policy, a seed; the event loop and the engines' step loop."""

    def __init__(
        self,
        scenario: Scenario | str,
        policy: Policy | str,
        seed: int,
        *,
        liveness: bool = False,
        timeline: bool = False,
        settings: Settings | None = None,
        hold_log: bool = False,
    ) -> None:
        """``hold_log``: keep every hold that ended (``books.ended``), for a comparison."""
        self.scenario = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
        self.policy = POLICIES[policy] if isinstance(policy, str) else policy
        self.seed = seed
        self.liveness = liveness
        self.settings = settings or Settings()
        self.base = f"kvproto-sim/{self.scenario.name}/{seed}"
        sc = self.scenario
        self.clock = Agenda()
        self.fabric = Fabric(
            LoopbackNetwork(
                seed=seed,
                detection_delay=sc.detection_delay,
                read_bandwidth=self.settings.read_bandwidth,
                default_link=sc.link,
            )
        )
        self.books = Books(self.clock, record_timeline=timeline, hold_log=hold_log)
        self.cluster = Cluster()
        self.ctx = Context(
            clock=self.clock,
            books=self.books,
            cluster=self.cluster,
            fabric=self.fabric,
            steps=self,
            scenario=sc,
            policy=self.policy,
            settings=self.settings,
            liveness=liveness,
        )
        self.events = 0
        max_prefill = self.settings.prefill_time(sc.prompt_tokens[1])
        for spec in sc.cluster:
            eng = EngineState(spec, sc.clocks.get(spec.name, NodeClock()))
            if spec.role == "D":
                eng.steps = StepClock(sc.d_steps, random.Random(f"{self.base}/steps/{spec.name}"))
                eng.max_step = sc.d_steps.max_step
            else:
                eng.max_step = max_prefill
            self.cluster.add(eng)
            self.start_engine(eng)
        rng = random.Random(f"{self.base}/workload")
        self.arrivals = generate(sc, rng, len(self.cluster.prefill), len(self.cluster.decode))
        self.fault_rng = random.Random(f"{self.base}/faults")

    @property
    def engines(self) -> dict[str, EngineState]:
        """Every engine by name."""
        return self.cluster.engines

    # --- the engines' step loop (context.Steps) -------------------------------------------
    def start_engine(self, eng: EngineState) -> None:
        """Bring up the next incarnation of ``eng``: endpoints, memory, lease side."""
        eng.incarnation += 1
        eng.alive = True
        eng.transports = []
        eng.pool = BlockPool(self.settings.pool_blocks)
        fabric = self.fabric
        for rank in range(eng.tp):
            name = f"{eng.name}r{rank}"
            if eng.incarnation == 1:
                real = fabric.net.endpoint(name, max_notification_size=MAX_NOTIFICATION)
            else:
                real = fabric.net.restart(name)
            layout = real.allocate_layout(1, block_len(eng.tp), self.settings.pool_blocks)
            real.register_blocks(layout)
            tr = SimTransport(
                self, self.clock, rank, real, skew=self.settings.rank_skew, seed=self.base
            )
            eng.transports.append(tr)
            fabric.live.append(tr)
            fabric.owner[real.local_peer] = (eng, rank)
        if eng.incarnation > 1:
            self._count(eng.side)  # the dead incarnation's counters
        eng.side = self.policy.make(
            eng.transports, eng.name, eng.incarnation, f"{self.base}/{eng.name}.{eng.incarnation}"
        )

    def request_wake(self, eng: EngineState, t: float) -> None:
        """Make ``eng`` step at its first boundary at or after ``t``."""
        if not eng.alive:
            return
        b = eng.boundary(max(t, self.clock.t))
        if eng.next_wake is not None and eng.next_wake <= b:
            return
        eng.next_wake = b

        def fire() -> None:
            if eng.next_wake == b and eng.alive:
                eng.next_wake = None
                self._wake(eng)

        self.clock.at(b, fire)

    def effects(self, eng: EngineState) -> None:
        """Act on everything the side reported, until it is quiet."""
        side = eng.side
        ctx = self.ctx
        reqs = self.cluster.reqs
        while fx := side.take():
            for rank, key, reason in fx.freed:
                flows.rank_freed(ctx, eng, rank, key, reason)
            for key, reason in fx.failed:
                req = reqs.get(key)
                if req is not None and req.reader is eng and req.state.waiting_for_blocks:
                    flows.fail(ctx, req, reason)
            for key, rank in fx.usable:
                req = reqs.get(key)
                # TRACKED too: a rank's read may be confirmed while another rank's is
                # still deferred; the request is used once every rank is.
                live = (ReqState.TRACKED, ReqState.READING)
                if req is not None and req.reader is eng and req.state in live:
                    req.ranks_ok.add(rank)
                    if len(req.ranks_ok) == eng.tp and req.state is ReqState.READING:
                        flows.use(ctx, req)
            for ask in fx.asks:
                handshake.handshake(ctx, eng, ask)

    def _wake(self, eng: EngineState) -> None:
        """One step boundary of ``eng``: handshakes, frames, timers, work, oracles."""
        t = self.clock.t
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
            flows.prefill_work(self.ctx, eng, now)
        flows.reader_work(self.ctx, eng, now)
        side.step(now)
        self.effects(eng)
        checks.holder_oracles(self.books, eng)
        timer = side.next_timer()
        if timer is not None:
            self.request_wake(eng, eng.clock.to_global(timer) if timer > -math.inf else t)

    # --- what the endpoints report (transport.RankHost) ------------------------------------
    def heartbeat_sent(self, nbytes: int) -> None:
        """A heartbeat (or its ack) left an endpoint."""
        metrics = self.books.metrics
        metrics.heartbeat_messages += 1
        metrics.heartbeat_bytes += nbytes

    def heartbeat_seen(self, tr: SimTransport, peer: PeerId) -> None:
        """A holder rank is about to process a heartbeat from ``peer`` (liveness bound L1)."""
        owner = self.fabric.owner
        sender = owner.get(peer)
        if sender is not None:
            eng, rank = owner[tr.real.local_peer]
            key = (eng.name, eng.incarnation, rank, sender[0].name)
            self.cluster.last_hb[key] = eng.clock.local(self.clock.t)

    def read_issued(self, tr: SimTransport, handle: ReadId, peer: PeerId, job: object) -> None:
        """A side issued a read through ``tr`` for the request ``job``."""
        if not isinstance(job, Req):
            raise SimError(f"a read was issued for {job!r}, not for a request")
        holder, holder_rank = self.fabric.owner[peer]
        rec = ReadRec(
            req=job,
            reader_rank=tr.rank,
            holder=holder,
            holder_rank=holder_rank,
            issued_at=self.clock.t,
        )
        job.reads.append(rec)
        self.fabric.reads[(tr.real.local_peer, handle)] = rec

    def delivered(self, tr: SimTransport, events: list[TransportEvent]) -> None:
        """Events for ``tr``'s rank: note read copies, queue them, wake the engine."""
        for ev in events:
            if isinstance(ev, ReadCompleted):
                flows.copied(self.ctx, tr, ev.read_id)
            elif isinstance(ev, ReadFailed):
                self.fabric.reads.pop((tr.real.local_peer, ev.read_id), None)
        tr.inbox.extend(events)
        self.request_wake(self.fabric.owner[tr.real.local_peer][0], self.clock.t)

    # --- the event loop ----------------------------------------------------------------------
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
        books = self.books
        for a in self.arrivals:
            books.open_requests += 1
            books.extra["requests"] += 1
            self.clock.at(a.at, functools.partial(flows.prefill_arrival, self.ctx, a))
        faults.schedule_faults(self.ctx, self.fault_rng)
        cap = self.settings.cap
        net = self.fabric.net
        clock = self.clock
        while True:
            tn = net.next_event_time()
            tm = clock.next_time()
            tn_ = math.inf if tn is None else tn
            if tn_ <= tm:
                if tn_ > cap:
                    break
                clock.t = tn_
                net.advance(tn_)
            else:
                if tm > cap:
                    break
                fire = clock.pop()
                clock.t = tm
                net.advance(tm)
                fire()
            self._collect()
            self.events += 1
            if books.open_requests == 0 and books.open_holds == 0 and books.faults_pending == 0:
                break
        return self._finish(time.perf_counter() - started)

    def _collect(self) -> None:
        """Take what the network delivered, note read copies, wake the receiving engines."""
        for tr in self.fabric.live:
            if tr.real.alive:
                events = tr.take_network_events()
                if events:
                    self.delivered(tr, events)

    def _finish(self, wall: float) -> RunResult:
        """Close the books: open holds, reclaim time, the result."""
        books = self.books
        end = self.clock.t
        for eng in self.cluster.engines.values():
            for hold in list(eng.holds.values()):
                if self.liveness:
                    books.violate(
                        "liveness",
                        "L3 leak",
                        f"{eng.name} still holds {hold.key[:18]} at the end of the run",
                    )
                if hold.dead_since is not None:
                    books.metrics.dead_block_seconds += hold.nblocks * (end - hold.dead_since)
        if books.crash_time is not None:
            ends = [h.ended_at if h.ended_at is not None else end for h in books.crash_holds]
            books.metrics.reclaim_s = max(ends, default=books.crash_time) - books.crash_time
        if books.drops:
            books.metrics.reclaim_s = max(
                (h.ended_at if h.ended_at is not None else end) - t for t, h in books.drops
            )
        for eng in self.cluster.engines.values():
            self._count(eng.side)
        extra = books.extra
        rec = books.rec
        extra["events"] = self.events
        extra["end_s"] = round(end, 3)
        extra["liveness_violations"] = rec.liveness_count
        return RunResult(
            scenario=self.scenario.name,
            policy=self.policy.name,
            seed=self.seed,
            metrics=books.metrics.as_dict(),
            violations=tuple(rec.safety),
            liveness=tuple(rec.liveness),
            liveness_violations=rec.liveness_count,
            extra=dict(extra),
            timeline=tuple(books.timeline) if books.record_timeline else (),
            wall_s=wall,
        )

    def _count(self, side: Side) -> None:
        """Add a side's own counters (vLLM's ``nixl_num_*``) to ``extra``."""
        extra = self.books.extra
        for key, value in side.counters().items():
            extra[key] = extra.get(key, 0) + value


def run(
    scenario: str, policy: str, seed: int, *, liveness: bool = False, timeline: bool = False
) -> RunResult:
    """Run one simulation."""
    return Simulator(scenario, policy, seed, liveness=liveness, timeline=timeline).run()
