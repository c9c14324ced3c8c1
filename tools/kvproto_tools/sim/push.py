"""Push mode in the simulator: the prefill engine WRITEs into the decoder's blocks.

One prefill engine P0 and one decoder D0 (TP 1) over the loopback network, with real
bytes: P prefills, the request reaches D (proxy hop), D allocates its blocks and
registers them with P, P's writer takes the registration after its queue wait and
WRITEs P's blocks into D's (the loopback write copies the bytes, then the notification
follows). D uses its blocks once the write is known to have landed in time, or gives
up and recomputes into them. spec/simulator.md, "Push mode", describes the model;
spec/push-mode.md the protocol.

Policies, as D guards its waiting blocks:

* ``kvproto``: the real cores through the binding: D's holder grants a writable lease at
  registration, P's reader (``writes=True``) claims it at once and heartbeats it while
  it queues, arms right before writing; D uses the blocks on ``FreeBlocks(DONE)``,
  recomputes on any other ``FreeBlocks`` and waits on ``WriteFenced``;
* ``vllm-lease``: vLLM 0.32.0's ``NixlPushConnector``: its watchdog
  (``push_registration_timeout``, 480 s) only drops the registration, so D waits for the
  write's notification, however long (spec/push-mode.md §1);
* ``fixed-480`` / ``fixed-short``: D frees at registration + 480 s (30 s) if no
  notification came, the obvious fix of the leak: the request recomputes into its
  blocks, and a WRITE that lands later overwrites them.

The oracle is the push twin of "used freed": ``written_freed`` counts WRITEs whose data
landed in D blocks that were no longer waiting for them (given up, recomputed into, or
handed to another request). Under kvproto it is a safety violation (S1w).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvproto.events import ReadDeclined, ReadDeferred, ReadGo, ReleaseReason
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto.ticket import LeaseTicket
from kvproto.transport import PeerId, Received, WriteCompleted, WriteFailed, WriteId
from kvproto_binding.step import Binding
from kvproto_tools.sim.engine import RunResult
from kvproto_tools.sim.memory import BlockPool, block_bytes, block_len, rank_heads
from kvproto_tools.sim.model import Metrics
from kvproto_tools.sim.oracles import Recorder
from kvproto_tools.sim.policies import KVPROTO_CONFIG, MAX_NOTIFICATION, POLICIES, Policy
from kvproto_tools.sim.scenarios import SCENARIOS, PushSpec, Scenario
from kvproto_tools.sim.settings import Settings
from kvproto_tools.sim.transport import heartbeat_kind
from kvproto_tools.sim.workload import Arrival, _wait, generate, prompt_blocks
from kvproto_transports.forwarding import ForwardingWrites
from kvproto_transports.loopback import LoopbackNetwork, LoopbackTransport
from kvproto_transports.loopback.endpoint import PendingRead

PUSH_CAP = 1200.0
"""Hard stop of a push run, simulated seconds (a policy that never frees runs to it)."""
DECODE_STEP = 0.04
"""Seconds per generated token on D."""
STEP = 0.01
"""P's writer retries its Arm round trip every this many seconds."""

_RESOLVED = frozenset({"used", "recomputed", "lost"})

GIVE_UP: dict[str, float | None] = {
    "fixed-480": 480.0,
    "fixed-short": 30.0,
    "vllm-v4": None,
    "vllm-lease": None,
}
"""Baselines: seconds after registration at which D gives up waiting (None: never)."""


@dataclass(slots=True, eq=False)
class PushReq:
    """One request of a push run."""

    arrival: Arrival
    blocks: int
    write_s: float
    state: str = "prefill"
    """prefill, transit, waiting (D's blocks wait for the write), used, recomputed, lost."""
    p_state: str = "none"
    """At P: none, queued (registration received), writing, written, failed."""
    p_blocks: list[int] = field(default_factory=list)
    d_blocks: list[int] = field(default_factory=list)
    registered_at: float = math.nan
    released_at: float | None = None
    """When D stopped waiting (used the blocks, or began recomputing into them)."""

    @property
    def key(self) -> str:
        return self.arrival.request_id


class _Counting(ForwardingWrites[LoopbackTransport]):
    """A loopback endpoint whose sends count keep-alive traffic into the run's metrics."""

    def __init__(self, inner: LoopbackTransport, metrics: Metrics) -> None:
        super().__init__(inner)
        self._metrics = metrics

    def send(self, peer: PeerId, payload: bytes) -> None:
        if heartbeat_kind(payload):
            self._metrics.heartbeat_messages += 1
            self._metrics.heartbeat_bytes += len(payload)
        self.inner.send(peer, payload)


class PushSimulator:
    """One push-mode run: a scenario with ``push``, a policy, a seed."""

    def __init__(
        self,
        scenario: Scenario | str,
        policy: Policy | str,
        seed: int,
        *,
        settings: Settings | None = None,
    ) -> None:
        self.scenario = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
        self.policy = POLICIES[policy] if isinstance(policy, str) else policy
        if self.scenario.push is None:
            raise ValueError(f"scenario {self.scenario.name} is not a push scenario")
        self.spec: PushSpec = self.scenario.push
        self.seed = seed
        self.settings = settings or Settings()
        self.kvproto = self.policy.name == "kvproto"
        self.give_up = None if self.kvproto else GIVE_UP[self.policy.name]
        base = f"kvproto-sim/{self.scenario.name}/{seed}"
        self.metrics = Metrics()
        self.recorder = Recorder()
        self.extra: dict[str, float | int] = {"corrupt_outputs": 0}
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.net = LoopbackNetwork(
            seed=seed,
            detection_delay=self.scenario.detection_delay,
            default_link=self.scenario.link,
        )
        self.net.transfer_delay = self._transfer_time
        self.net.on_transfer = self._landed
        pool = self.settings.pool_blocks
        self.p_real = self.net.endpoint("P0", max_notification_size=MAX_NOTIFICATION)
        self.d_real = self.net.endpoint("D0", max_notification_size=MAX_NOTIFICATION)
        for real in (self.p_real, self.d_real):
            real.register_blocks(real.allocate_layout(1, block_len(1), pool))
        self.p_pool, self.d_pool = BlockPool(pool), BlockPool(pool)
        self.d_real.add_peer(self.p_real.metadata())  # the registration introduces P to D
        self.d_peer = self.p_real.add_peer(self.d_real.metadata())
        self.p = _Counting(self.p_real, self.metrics)
        self.d = _Counting(self.d_real, self.metrics)
        self.d_end, self.p_end = self._endpoints()
        self.reqs, self.writer_waits = self._requests(base)
        self.by_p_block: dict[int, PushReq] = {}
        self.p_writes: dict[WriteId, PushReq] = {}
        """Baselines: P's writes in flight."""
        self.p_alive = True
        self.p_busy_until = 0.0
        self.p_stalled_until = -math.inf
        self.crashed_at: float | None = None
        self.waiting_at_crash: list[PushReq] = []
        if self.spec.prefill_crash is not None:
            self.at(self.spec.prefill_crash, self._crash)

    def _endpoints(self) -> tuple[Binding | None, Binding | None]:
        """kvproto: D's holder and P's writer, each through the binding (None, None else)."""
        if not self.kvproto:
            return None, None
        holder = Holder(KVPROTO_CONFIG, engine="D0", incarnation=1)
        writer = Reader(KVPROTO_CONFIG, engine="P0", incarnation=1)
        return Binding(self.d, holder=holder), Binding(self.p, reader=writer)

    def _requests(self, base: str) -> tuple[dict[str, PushReq], dict[str, float]]:
        """The run's requests (the same under every policy) and P's queue wait for each."""
        arrivals = generate(self.scenario, random.Random(f"{base}/workload"), 1, 1)
        draw = random.Random(f"{base}/push")
        reqs: dict[str, PushReq] = {}
        for a in arrivals:
            slow = bool(self.spec.slow_every) and (a.index + 1) % self.spec.slow_every == 0
            write_s = draw.uniform(*(self.spec.slow_s if slow else self.spec.write_s))
            req = PushReq(a, prompt_blocks(a.prompt_tokens), write_s)
            reqs[req.key] = req
            self.at(a.at, functools.partial(self._arrive, req))
        waits = {key: _wait(self.spec.writer_wait, draw) for key in reqs}
        if self.spec.stall_every:
            t = self.spec.stall_every
            while t < self.scenario.arrival_window + self.spec.stall_s[1]:
                self.at(t, functools.partial(self._stall, draw.uniform(*self.spec.stall_s)))
                t += self.spec.stall_every
        return reqs, waits

    def _stall(self, seconds: float) -> None:
        """P stops stepping for ``seconds`` (a long step, a GC pause, a stalled host)."""
        self.p_stalled_until = max(self.p_stalled_until, self.now + seconds)
        self.recorder.note(self.now, f"P stalls until {self.p_stalled_until:.1f}")

    # ------------------------------------------------------------ the loop

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), fn))

    def run(self) -> RunResult:
        """Simulate until every request is resolved (or the cap); the run's figures."""
        # As the pull model: faults are the simulator's job, so the binding's warnings
        # about them stay quiet while it runs.
        binding_log = logging.getLogger("kvproto.binding")
        level = binding_log.level
        binding_log.setLevel(logging.ERROR)
        try:
            return self._run()
        finally:
            binding_log.setLevel(level)

    def _run(self) -> RunResult:
        started = time.perf_counter()
        while True:
            t = self._next_time()
            if t > PUSH_CAP or not math.isfinite(t):
                break
            self.now = t
            self.net.advance(t)
            while self._heap and self._heap[0][0] <= t:
                heapq.heappop(self._heap)[2]()
            self._step(t)
            if self._quiet():
                break
        if any(r.state == "waiting" for r in self.reqs.values()):
            self.now = PUSH_CAP  # blocks still wait: the run stands until its cap
        return self._result(time.perf_counter() - started)

    def _next_time(self) -> float:
        times = [self._heap[0][0] if self._heap else math.inf]
        net = self.net.next_event_time()
        times.append(math.inf if net is None else net)
        for end in (self.d_end, self.p_end if self._p_steps() else None):
            due = None if end is None else end.next_deadline()
            if due is not None:
                times.append(max(due, self.now))
        return min(times)

    def _p_steps(self) -> bool:
        return self.p_alive and self.now >= self.p_stalled_until

    def _quiet(self) -> bool:
        """Every request resolved and decoded (its decode's end is an event too)."""
        return not self._heap and all(r.state in _RESOLVED for r in self.reqs.values())

    def _step(self, t: float) -> None:
        if self.kvproto:
            self._step_kvproto(t)
        else:
            self._step_stock(t)

    # ------------------------------------------------------------ the flow

    def _arrive(self, req: PushReq) -> None:
        if not self.p_alive:
            req.state = "lost"
            return
        start = max(self.now, self.p_busy_until)
        self.p_busy_until = start + self.settings.prefill_time(req.arrival.prompt_tokens)
        self.at(self.p_busy_until, lambda: self._prefilled(req))

    def _prefilled(self, req: PushReq) -> None:
        if not self.p_alive:
            req.state = "lost"
            return
        blocks = self.p_pool.allocate(req.blocks, req)
        if blocks is None:
            req.state = "lost"
            return
        req.p_blocks = blocks
        heads = rank_heads(0, 1)
        for i, b in enumerate(blocks):
            self.p_real.write_block(0, b, block_bytes(req.arrival.index, i, heads))
            self.by_p_block[b] = req
        req.state = "transit"
        self.at(self.now + self.settings.proxy_delay, lambda: self._d_allocates(req))

    def _d_allocates(self, req: PushReq) -> None:
        blocks = self.d_pool.allocate(req.blocks, req)
        if blocks is None:
            req.state = "lost"
            return
        req.d_blocks = blocks
        req.state = "waiting"
        req.registered_at = self.now
        ticket: object = None
        if self.d_end is not None and self.d_end.holder is not None:
            ticket = self.d_end.holder.grant(self.now, request_id=req.key, writable=True)
        elif self.give_up is not None:
            self.at(self.now + self.give_up, lambda: self._give_up(req, "timeout"))
        link = self.net.link("D0", "P0").delay
        self.at(self.now + link, lambda: self._registered(req, ticket))

    def _registered(self, req: PushReq, ticket: object) -> None:
        """The registration (D's ticket and block ids) reached P."""
        if not self.p_alive:
            return
        req.p_state = "queued"
        if self.p_end is not None and self.p_end.reader is not None:
            assert isinstance(ticket, LeaseTicket)
            self.p_end.reader.track(self.now, request_id=req.key, ticket=ticket, writes=True)
        self.at(self.now + self.writer_waits[req.key], lambda: self._write(req))

    def _write(self, req: PushReq) -> None:
        if not self.p_alive or req.p_state != "queued":
            return
        if self.now < self.p_stalled_until:
            self.at(self.p_stalled_until, lambda: self._write(req))
            return
        if self.p_end is None:
            write_id = self.p.write_blocks(
                self.d_peer,
                local_blocks=req.p_blocks,
                remote_blocks=req.d_blocks,
                notify=req.key.encode(),
            )
            self.p_writes[write_id] = req
            self._writing(req)
            return
        reader = self.p_end.reader
        assert reader is not None
        if not reader.is_tracked(req.key):
            req.p_state = "failed"
            return
        if not reader.write_ready(req.key):
            self.at(self.now + STEP, lambda: self._write(req))
            return
        go = self.p_end.start_write(
            self.now, req.key, local_blocks=req.p_blocks, remote_blocks=req.d_blocks
        )
        if isinstance(go, ReadDeferred):
            self.at(self.now + STEP, lambda: self._write(req))
        elif isinstance(go, ReadGo):
            self._writing(req)
        else:
            assert isinstance(go, ReadDeclined)
            req.p_state = "failed"

    def _writing(self, req: PushReq) -> None:
        req.p_state = "writing"

    def _transfer_time(self, read: PendingRead) -> float:
        req = self.by_p_block.get(read.local_blocks[0]) if read.local_blocks else None
        return 0.0 if req is None or not read.write else req.write_s

    def _landed(self, read: PendingRead) -> None:
        """A WRITE's data just landed in D's memory: was D still waiting for it there?"""
        if not read.write or not read.local_blocks:
            return
        req = self.by_p_block[read.local_blocks[0]]
        req.p_state = "written"
        ok = req.state == "waiting" and self.d_pool.owns(list(read.remote_blocks), req)
        if not ok:
            self.metrics.written_freed += 1
            self.recorder.note(self.now, f"{req.key}: WRITE landed in blocks D let go")
            if self.kvproto:
                self._violate("S1w", f"{req.key}'s WRITE landed after D let its blocks go")

    def _crash(self) -> None:
        self.p_alive = False
        self.crashed_at = self.now
        self.waiting_at_crash = [r for r in self.reqs.values() if r.state == "waiting"]
        self.net.crash("P0")

    # ------------------------------------------------------------ D's decisions

    def _use(self, req: PushReq) -> None:
        """D's blocks are filled: check the bytes, decode, free."""
        if req.state != "waiting":
            return
        req.state = "used"
        req.released_at = self.now
        if not self._bytes_ok(req):
            self.extra["corrupt_outputs"] += 1
            if self.kvproto:
                self._violate("S0", f"{req.key} used D blocks that do not hold its KV")
        self._decode(req)

    def _give_up(self, req: PushReq, why: str) -> None:
        """D stops waiting and recomputes the prompt into its blocks."""
        if req.state != "waiting":
            return
        if self.p_alive and req.p_state in ("queued", "writing"):
            self.metrics.premature_frees += 1
        req.state = "recomputed"
        req.released_at = self.now
        self.metrics.wasted_prefill_tokens += req.arrival.prompt_tokens
        heads = rank_heads(0, 1)
        for i, b in enumerate(req.d_blocks):
            self.d_real.write_block(0, b, block_bytes(req.arrival.index, i, heads))
        self.recorder.note(self.now, f"{req.key}: D recomputes ({why})")
        self._decode(req)

    def _decode(self, req: PushReq) -> None:
        def done() -> None:
            if not self._bytes_ok(req):
                self.extra["corrupt_outputs"] += 1
                if self.kvproto:
                    self._violate("S0", f"{req.key}'s blocks changed under its decode")
            if self.d_pool.release(req.d_blocks, req):
                self._violate("S4", f"{req.key}'s D blocks freed twice")

        self.at(self.now + req.arrival.output_tokens * DECODE_STEP, done)

    def _bytes_ok(self, req: PushReq) -> bool:
        heads = rank_heads(0, 1)
        return all(
            self.d_real.read_block(0, b) == block_bytes(req.arrival.index, i, heads)
            for i, b in enumerate(req.d_blocks)
        )

    def _p_done(self, req: PushReq) -> None:
        """P is done with its source blocks (written, failed or given up)."""
        if req.p_blocks and self.p_pool.owns(req.p_blocks, req):
            self.p_pool.release(req.p_blocks, req)

    # ------------------------------------------------------------ the two kinds of D

    def _step_kvproto(self, t: float) -> None:
        assert self.d_end is not None and self.p_end is not None
        result = self.d_end.step(t)
        for fenced in result.fenced:
            self.recorder.note(t, f"{fenced.request_id}: WriteFenced {fenced.reason.name}")
        for freed in result.freed:
            req = self.reqs[freed.request_id]
            if freed.reason is ReleaseReason.DONE:
                self._use(req)
            else:
                self._give_up(req, freed.reason.name)
        if not self._p_steps():
            return
        p_result = self.p_end.step(t)
        for connect in p_result.connects:
            rtt = self.net.link("P0", "D0").delay + self.net.link("D0", "P0").delay

            def connected(c=connect) -> None:  # type: ignore[no-untyped-def]
                if self.p_alive and self.p_end is not None:
                    meta = self.d_real.metadata()
                    self.p_end.connected(self.now, engine=c.engine, rank=c.rank, metadata=meta)

            self.at(t + rtt + self.settings.handshake_cost, connected)
        for failed in p_result.failed:
            req = self.reqs[failed.request_id]
            req.p_state = "failed" if req.p_state != "written" else req.p_state
            self._p_done(req)
            self.p_end.reader.finish(t, failed.request_id)  # type: ignore[union-attr]
        for rid in p_result.confirmed:
            self._p_done(self.reqs[rid])
            self.p_end.reader.finish(t, rid)  # type: ignore[union-attr]

    def _step_stock(self, t: float) -> None:
        for event in self.d_real.poll():
            if isinstance(event, Received):
                req = self.reqs.get(event.payload.decode(errors="replace"))
                if req is not None:
                    self._use(req)
            # PeerLost: vLLM 0.32's push does nothing with a lost peer (spec/push-mode.md §1).
        if not self.p_alive:
            return
        for event in self.p_real.poll():
            if isinstance(event, (WriteCompleted, WriteFailed)):
                req = self.p_writes.pop(event.write_id)
                if isinstance(event, WriteFailed):
                    req.p_state = "failed"
                self._p_done(req)

    # ------------------------------------------------------------ figures

    def _violate(self, kind: str, detail: str) -> None:
        self.metrics.safety_violations += 1
        self.recorder.violate("safety", kind, self.now, detail)

    def _result(self, wall: float) -> RunResult:
        end = self.now
        m = self.metrics
        if self.crashed_at is not None:
            waited = self.waiting_at_crash
            released = [r.released_at for r in waited]
            stranded = [r for r in waited if r.released_at is None]
            last = max((x for x in released if x is not None), default=self.crashed_at)
            m.reclaim_s = (end if stranded else last) - self.crashed_at
            m.dead_block_seconds = sum(
                r.blocks * ((end if r.released_at is None else r.released_at) - self.crashed_at)
                for r in waited
            )
            self.extra["stranded_blocks"] = sum(r.blocks for r in stranded)
            freed = [x for x in released if x is not None]
            self.extra["reclaim_freed_s"] = (max(freed) - self.crashed_at) if freed else 0.0
        if self.d_end is not None and self.d_end.holder is not None:
            self.extra["write_fenced"] = self.d_end.holder.stats.write_fenced
        self.extra["requests"] = len(self.reqs)
        self.extra["used"] = sum(r.state == "used" for r in self.reqs.values())
        self.extra["recomputed"] = sum(r.state == "recomputed" for r in self.reqs.values())
        return RunResult(
            scenario=self.scenario.name,
            policy=self.policy.name,
            seed=self.seed,
            metrics=m.as_dict(),
            violations=tuple(self.recorder.safety),
            extra=dict(self.extra),
            wall_s=wall,
        )
