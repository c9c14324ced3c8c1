"""The simulator's records: engines, holds (blocks kept for a reader), requests, reads, figures."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvproto_tools.sim.memory import BlockPool

if TYPE_CHECKING:
    from kvproto_tools.sim.clock import NodeClock, StepClock
    from kvproto_tools.sim.scenarios import EngineSpec
    from kvproto_tools.sim.sides import HandshakeAsk, Side
    from kvproto_tools.sim.transport import SimTransport
    from kvproto_tools.sim.workload import Arrival


class EngineState:
    """One engine (all its ranks) and its current incarnation."""

    def __init__(self, spec: EngineSpec, clock: NodeClock) -> None:
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


class ReqState(enum.Enum):
    """Where a request stands at its reader engine."""

    THINKING = "thinking"
    """Turn 2 only: the client holds the ticket and has not come back yet."""
    TRANSIT = "transit"
    """On its way to the reader engine (routing proxy hop)."""
    TRACKED = "tracked"
    """In the reader's queue; the lease is being kept alive."""
    READING = "reading"
    """Reads issued."""
    USED = "used"
    """The loaded blocks were used (kvproto: confirmed; baselines: read completed)."""
    FAILED = "failed"
    """The reader could not use the blocks: recomputed."""
    LOST = "lost"
    """The reader engine died, or the holder died before the request reached its reader."""

    @property
    def waiting_for_blocks(self) -> bool:
        """A live reader still needs the holder's blocks."""
        return self in _WAITING


_WAITING = frozenset({ReqState.TRANSIT, ReqState.TRACKED, ReqState.READING})


@dataclass(slots=True, eq=False)
class Hold:
    """One request's KV blocks kept by a holder engine (turn 1 on P, turn 2 on D)."""

    key: str
    """The holder's request id."""
    engine: EngineState
    """The holder engine."""
    incarnation: int
    """Holder incarnation that owns the memory."""
    blocks: list[int]
    """Block ids (the same on every rank)."""
    content: int
    """Content tag written into the blocks."""
    granted_at: float
    """Global time of the grant."""
    granted_local: float
    """Holder-clock time of the grant."""
    ttl: float
    """Initial lease (or fixed timeout), seconds."""
    ranks_live: set[int]
    """Holder ranks that have not freed their lease yet."""
    ticket: Any = None
    """What travels to the reader (a kvproto LeaseTicket or a baseline ticket)."""
    req: Req | None = None
    """The request that will read these blocks."""
    ended_at: float | None = None
    """When every rank freed (or the memory vanished with the engine)."""
    lost: bool = False
    """The holder engine died: the memory vanished rather than being freed."""
    end_reason: str = ""
    """Why the last rank freed it ("expired", "done", "aborted", ...; "lost" with the engine)."""
    dead_since: float | None = None
    """Since when no live reader will use the blocks (None: still needed, or unknown yet)."""
    deadlines: dict[int, float] = field(default_factory=dict)
    """Per rank, the last deadline the holder reported (oracle S2)."""

    @property
    def nblocks(self) -> int:
        """Number of blocks."""
        return len(self.blocks)


@dataclass(slots=True, eq=False)
class ReadRec:
    """One transfer issued by a reader rank from a holder rank."""

    req: Req
    """The request."""
    reader_rank: int
    """Issuing rank."""
    holder: EngineState
    """Holder engine."""
    holder_rank: int
    """Holder rank read from."""
    issued_at: float
    """Global time the read was issued."""
    copied_at: float | None = None
    """Global time the data was copied (the loopback copies at completion)."""
    intact: bool | None = None
    """At copy time every block still belonged to the hold (False: it overlapped a free)."""


@dataclass(slots=True, eq=False)
class Req:
    """A request at its reader engine (turn 1: D reads P's blocks; turn 2: P reads D's)."""

    key: str
    """Request id (the hold's key)."""
    turn: int
    """1 or 2."""
    arrival: Arrival
    """The workload draw behind it."""
    hold: Hold
    """The blocks it reads."""
    tokens: int
    """Tokens recomputed if the blocks cannot be used (prompt, or whole context in turn 2)."""
    state: ReqState = ReqState.TRANSIT
    """Where it stands."""
    reader: EngineState | None = None
    """Reader engine."""
    admit_at: float = 0.0
    """Global time it leaves the reader's queue."""
    local_blocks: list[int] | None = None
    """Reader-side blocks it reads into."""
    ranks_ok: set[int] = field(default_factory=set)
    """Reader ranks whose part is usable."""
    reads: list[ReadRec] = field(default_factory=list)
    """Transfers issued."""
    reads_copied: int = 0
    """Transfers whose data was copied."""
    finished: bool = False
    """The reader side was told the request left its scheduler."""


@dataclass(slots=True)
class Metrics:
    """The figures of one run (spec/simulator.md defines each)."""

    reclaim_s: float | None = None
    dead_block_seconds: float = 0.0
    premature_frees: int = 0
    overlapped_reads: int = 0
    wasted_prefill_tokens: int = 0
    heartbeat_bytes: int = 0
    heartbeat_messages: int = 0
    safety_violations: int = 0
    written_freed: int = 0

    def as_dict(self) -> dict[str, float | int | None]:
        """The JSON ``metrics`` object (floats rounded to the millisecond for stable output)."""
        return {
            "reclaim_s": None if self.reclaim_s is None else round(self.reclaim_s, 3),
            "dead_block_seconds": round(self.dead_block_seconds, 3),
            "premature_frees": self.premature_frees,
            "overlapped_reads": self.overlapped_reads,
            "wasted_prefill_tokens": self.wasted_prefill_tokens,
            "heartbeat_bytes": self.heartbeat_bytes,
            "heartbeat_messages": self.heartbeat_messages,
            "safety_violations": self.safety_violations,
            "written_freed": self.written_freed,
        }


METRIC_KEYS: tuple[str, ...] = tuple(Metrics().as_dict())
"""The metric names, in JSON order."""
