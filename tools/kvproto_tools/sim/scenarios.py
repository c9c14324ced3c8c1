"""The named scenarios: one fault (or none) each, on the same cluster and workload shape.

Every scenario runs two prefill engines (P0 with TP 1, P1 with TP 2) and two
decode engines (D0 with TP 2, D1 with TP 1), so every pairing of tensor
parallel layouts occurs: one holder rank read by two reader ranks (P0→D0),
one reader rank reading two holder ranks (P1→D1), and equal layouts.
spec/simulator.md describes each scenario and why its parameters are what they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvproto_tools.sim.clock import NodeClock, StepModel
from kvproto_transports.loopback import LinkFaults


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    """One engine of the simulated cluster."""

    name: str
    """Engine name (its endpoints are ``<name>r<rank>``)."""
    role: str
    """``"P"`` (prefill: holds turn-1 blocks, reads turn-2) or ``"D"`` (the reverse)."""
    tp: int
    """Tensor-parallel size: one holder/reader and one transport endpoint per rank."""


CLUSTER: tuple[EngineSpec, ...] = (
    EngineSpec(name="P0", role="P", tp=1),
    EngineSpec(name="P1", role="P", tp=2),
    EngineSpec(name="D0", role="D", tp=2),
    EngineSpec(name="D1", role="D", tp=1),
)

NETWORK = LinkFaults(delay=0.0005, jitter=0.0005)
"""Healthy links: half a millisecond one way, plus up to half a millisecond of jitter."""


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueWait:
    """How long a request waits in the reader's queue before it is scheduled (and reads)."""

    kind: str = "exp"
    """``"exp"`` (exponential with mean ``a``, capped at ``b``) or ``"uniform"`` on ``[a, b]``."""
    a: float = 1.0
    """Mean (exp) or lower end (uniform), seconds."""
    b: float = 20.0
    """Cap (exp) or upper end (uniform), seconds."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultEvent:
    """One change at a moment of a scenario's fault timeline (``Scenario.events``)."""

    at: float
    """Global time, seconds."""
    action: str
    """``kill`` (kill -9), ``restart`` (the next incarnation), ``cut`` or ``heal`` (every link
    between two engines), ``loss`` (drop ``drop`` of the frames between two engines, each
    way) or ``lossless`` (their links healthy again)."""
    engines: tuple[str, ...]
    """The engine (kill, restart) or the two engines (the others)."""
    drop: float = 0.0
    """``loss``: the fraction of frames dropped."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PushSpec:
    """What a push-mode scenario adds: P writes into D's blocks (spec/push-mode.md).

    The cluster is one prefill engine P0 and one decoder D0 (TP 1 each); spec/simulator.md,
    "Push mode", describes the model.
    """

    writer_wait: QueueWait = field(default_factory=lambda: QueueWait(kind="exp", a=0.2, b=2.0))
    """How long a registration waits at P before P writes it (P's own queue)."""
    write_s: tuple[float, float] = (0.05, 0.5)
    """How long one WRITE takes, seconds (uniform)."""
    slow_every: int = 0
    """Every ``slow_every``-th write takes ``slow_s`` instead (0: none)."""
    slow_s: tuple[float, float] = (40.0, 90.0)
    """A slow write's duration range, seconds (uniform)."""
    stall_every: float = 0.0
    """P stalls (no step: no heartbeat, no new write) every this many seconds (0: never),
    while the writes it posted go on."""
    stall_s: tuple[float, float] = (20.0, 60.0)
    """A stall's duration range, seconds (uniform)."""
    prefill_crash: float | None = None
    """When P0 dies (kill -9), global seconds; None: it does not."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """A workload plus at most one kind of fault."""

    name: str
    """Command-line name."""
    summary: str
    """One line: what happens."""
    headline: str
    """The figure this scenario is about (a metrics key)."""
    arrival_rate: float = 1.5
    """Poisson arrivals per second at the prefill tier."""
    arrival_window: float = 120.0
    """Requests arrive during ``[0, arrival_window)``; the run then continues until quiet."""
    prompt_tokens: tuple[int, int] = (128, 2048)
    """Prompt length range (log-uniform)."""
    output_tokens: tuple[int, int] = (32, 256)
    """Generated tokens range (uniform)."""
    queue_wait: QueueWait = field(default_factory=QueueWait)
    """Decode queue wait before a request is scheduled and reads its blocks."""
    d_steps: StepModel = field(default_factory=lambda: StepModel(step=0.04))
    """Decode forward-step durations."""
    link: LinkFaults = NETWORK
    """Faults of every link."""
    detection_delay: float = 1.0
    """Seconds from an endpoint's death to PeerLost at its peers (inf: never reported)."""
    decode_crash: tuple[str, float] | None = None
    """(engine, time): kill -9 of a decode engine."""
    prefill_restart: tuple[str, float, float] | None = None
    """(engine, time, downtime): a prefill engine dies and comes back as a new incarnation."""
    partition: tuple[str, str, float, tuple[float, float]] | None = None
    """(engine a, engine b, start, duration range): cut every link between them, then heal."""
    clocks: dict[str, NodeClock] = field(default_factory=dict)
    """Per-engine clocks (default: offset 0, no drift)."""
    turn2_fraction: float = 0.0
    """Fraction of requests with a second turn whose KV blocks the decoder holds."""
    think_mean: float = 240.0
    """Mean client think time before turn 2, seconds (exponential)."""
    drop_fraction: float = 0.0
    """Fraction of granted requests the router drops before they reach a decoder (it
    fails them, or their client leaves, between the prefill's answer and the decoder):
    nobody will claim their leases."""
    router_release: bool = False
    """The router hands the holder the ticket of each request it drops (a release path no
    router offers today; spec/timing.md weighs it against the claim window)."""
    cluster: tuple[EngineSpec, ...] = CLUSTER
    """The engines (default: the four of :data:`CLUSTER`)."""
    events: tuple[FaultEvent, ...] = ()
    """Any number of faults at given times, beside (or instead of) the single ones above:
    how a chaos run's schedule is replayed (spec/chaos.md)."""
    push: PushSpec | None = None
    """Push mode: P writes into D's blocks (:mod:`kvproto_tools.sim.push` runs it)."""


_SKEW = {
    "P0": NodeClock(offset=+3600.0, drift_ppm=+200.0),
    "P1": NodeClock(offset=-3600.0, drift_ppm=-200.0),
    "D0": NodeClock(offset=-3600.0, drift_ppm=-200.0),
    "D1": NodeClock(offset=+3600.0, drift_ppm=+200.0),
}

_PUSH_CRASH = PushSpec(
    writer_wait=QueueWait(kind="exp", a=5.0, b=30.0), write_s=(0.5, 2.0), prefill_crash=60.0
)
"""P killed at 60 s while its writer queue (up to 30 s) keeps D's blocks waiting."""

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            name="normal",
            summary="healthy cluster, short decode queues",
            headline="heartbeat_bytes",
        ),
        Scenario(
            name="decode-crash",
            summary="D0 killed (kill -9, silent: no transport report) at 60 s while requests wait",
            headline="reclaim_s",
            queue_wait=QueueWait(kind="exp", a=10.0, b=90.0),
            detection_delay=float("inf"),
            decode_crash=("D0", 60.0),
        ),
        Scenario(
            name="decode-crash-reported",
            summary="D0 killed at 60 s while requests wait; the transport reports the loss "
            "1 s later (PEER_LOST)",
            headline="reclaim_s",
            queue_wait=QueueWait(kind="exp", a=10.0, b=90.0),
            detection_delay=1.0,
            decode_crash=("D0", 60.0),
        ),
        Scenario(
            name="decode-overload",
            summary="decode queues of up to 10x the 30 s lease (0-300 s)",
            headline="premature_frees",
            arrival_rate=0.5,
            queue_wait=QueueWait(kind="uniform", a=0.0, b=300.0),
        ),
        Scenario(
            name="slow-forward",
            summary="decode forward steps of 1-20 s now and then (heartbeats wait for them)",
            headline="overlapped_reads",
            queue_wait=QueueWait(kind="exp", a=10.0, b=90.0),
            d_steps=StepModel(step=0.04, slow_range=(1.0, 20.0), slow_every=20.0),
        ),
        Scenario(
            name="lossy",
            summary="5% drop, 5% duplicate, 5% reorder, 1-5 ms delay on every link",
            headline="overlapped_reads",
            queue_wait=QueueWait(kind="exp", a=5.0, b=60.0),
            link=LinkFaults(
                drop=0.05,
                duplicate=0.05,
                reorder=0.05,
                delay=0.001,
                jitter=0.004,
                reorder_window=0.01,
            ),
        ),
        Scenario(
            name="partition",
            summary="D1 cut off from P1 for 10-60 s at 40 s, then healed",
            headline="overlapped_reads",
            queue_wait=QueueWait(kind="exp", a=10.0, b=90.0),
            partition=("D1", "P1", 40.0, (10.0, 60.0)),
        ),
        Scenario(
            name="prefill-restart",
            summary="P1 dies at 50 s and restarts 10 s later as a new incarnation",
            headline="wasted_prefill_tokens",
            queue_wait=QueueWait(kind="exp", a=10.0, b=90.0),
            prefill_restart=("P1", 50.0, 10.0),
        ),
        Scenario(
            name="clock-skew",
            summary="clocks offset by +-1 h, drifting +-200 ppm; half the requests have a turn 2",
            headline="overlapped_reads",
            queue_wait=QueueWait(kind="exp", a=5.0, b=60.0),
            clocks=_SKEW,
            turn2_fraction=0.5,
        ),
        Scenario(
            name="router-drop",
            summary="the router drops 10% of granted requests before they reach a decoder",
            headline="reclaim_s",
            drop_fraction=0.1,
        ),
        Scenario(
            name="bidirectional",
            summary="half the requests have a turn 2 read back from D's blocks (480 s TTL)",
            headline="wasted_prefill_tokens",
            turn2_fraction=0.5,
        ),
        Scenario(
            name="push-normal",
            summary="push mode: P writes into D's blocks, healthy",
            headline="heartbeat_bytes",
            push=PushSpec(),
        ),
        Scenario(
            name="push-prefill-crash",
            summary="push mode: P killed at 60 s (silent) while D's blocks wait for its "
            "writes (P's writer queue: up to 30 s)",
            headline="reclaim_s",
            detection_delay=float("inf"),
            push=_PUSH_CRASH,
        ),
        Scenario(
            name="push-prefill-crash-reported",
            summary="push mode: P killed at 60 s while D's blocks wait; the transport reports "
            "the loss 1 s later (PEER_LOST)",
            headline="reclaim_s",
            detection_delay=1.0,
            push=_PUSH_CRASH,
        ),
        Scenario(
            name="push-prefill-overload",
            summary="push mode: P writes each registration 0-300 s after it arrived (10x the "
            "30 s lease)",
            headline="premature_frees",
            arrival_rate=0.5,
            push=PushSpec(writer_wait=QueueWait(kind="uniform", a=0.0, b=300.0)),
        ),
        Scenario(
            name="push-slow-write",
            summary="push mode: every 10th WRITE takes 40-90 s, more than the 30 s lease "
            "(P keeps stepping)",
            headline="written_freed",
            push=PushSpec(slow_every=10),
        ),
        Scenario(
            name="push-prefill-stall",
            summary="push mode: P stalls for 25-60 s every 45 s (no heartbeat) while writes of "
            "5-40 s it posted go on",
            headline="written_freed",
            push=PushSpec(write_s=(5.0, 40.0), stall_every=45.0, stall_s=(25.0, 60.0)),
        ),
    )
}

DEFAULT_SET: tuple[str, ...] = tuple(SCENARIOS)
"""What ``kvproto simulate`` runs with no arguments: every scenario."""

FAULT_SCENARIOS: tuple[str, ...] = tuple(n for n in SCENARIOS if not n.endswith("normal"))
"""The scenarios that inject a fault (the CI sweep rotates through these)."""
