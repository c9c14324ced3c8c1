"""Policies as seen by one engine: the lease logic of all its ranks behind one interface.

A *side* owns an engine's holder and reader objects (one per TP rank) and
talks to the network only through the engine's :class:`SimTransport`
endpoints. The simulator calls it at the engine's step boundaries and
collects what happened as :class:`Effects`. The sides:

* :class:`kvproto_tools.sim.kvproto_side.KvprotoSide` runs the real core
  through the project's binding, exactly as a deployment does;
* :class:`kvproto_tools.sim.vllm_side.VllmSide` runs the restatement of vLLM
  0.32.0's leases; with heartbeats off it is vLLM before leases (one fixed
  timeout).

A side knows the simulator's holds and requests only through
:class:`HeldBlocks` and :class:`ReadJob`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvproto_tools.sim.transport import SimTransport


class HeldBlocks(Protocol):
    """What a side reads of the blocks it grants (:class:`kvproto_tools.sim.model.Hold`)."""

    @property
    def key(self) -> str:
        """The holder's request id."""

    @property
    def ttl(self) -> float:
        """Initial lease, seconds."""

    @property
    def blocks(self) -> list[int]:
        """Block ids on the holder."""

    @property
    def ticket(self) -> object:
        """What :meth:`Side.grant` returned for them."""


class ReadJob(Protocol):
    """What a side reads of a request it reads for (:class:`kvproto_tools.sim.model.Req`)."""

    @property
    def key(self) -> str:
        """Request id (the hold's key)."""

    @property
    def turn(self) -> int:
        """1 (reading prefill blocks) or 2 (reading a decoder's turn-2 blocks)."""

    @property
    def hold(self) -> HeldBlocks:
        """The blocks it reads."""

    @property
    def local_blocks(self) -> list[int] | None:
        """Reader-side blocks it reads into (set before :meth:`Side.try_read`)."""


class ReadStart(enum.Enum):
    """Outcome of :meth:`Side.try_read`."""

    STARTED = "started"
    """Reads issued."""
    WAIT = "wait"
    """Not connected yet, or deferred for an early heartbeat: try again at a later step."""
    DECLINED = "declined"
    """The reader refused to read (reported in ``Effects.failed``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HandshakeAsk:
    """A reader rank needs a connection to some ranks of a holder engine."""

    rank: int
    """Reader rank."""
    engine_id: str
    """Holder engine id (kvproto: engine name; vLLM: name.incarnation)."""
    holder_ranks: tuple[int, ...]
    """Holder ranks to connect to."""


@dataclass(slots=True)
class Effects:
    """What the engine must act on after a call into its side."""

    freed: list[tuple[int, str, str]] = field(default_factory=list)
    """(holder rank, hold key, why: "expired", "done", "aborted", "revoked", ...)."""
    failed: list[tuple[str, str]] = field(default_factory=list)
    """(request key, reason): the reader cannot use the blocks."""
    usable: list[tuple[str, int]] = field(default_factory=list)
    """(request key, reader rank): that rank's loaded blocks may be used."""
    asks: list[HandshakeAsk] = field(default_factory=list)
    """Connections to make."""

    def __bool__(self) -> bool:
        return bool(self.freed or self.failed or self.usable or self.asks)


class Side(ABC):
    """One engine's lease logic, all ranks."""

    renew_extension: float | None
    """How far a heartbeat extends a lease (None: nothing renews), for the liveness bound."""

    def __init__(self, transports: list[SimTransport], name: str, incarnation: int) -> None:
        self.transports = transports
        self.name = name
        self.incarnation = incarnation
        self.tp = len(transports)
        self.effects = Effects()

    def take(self) -> Effects:
        """Effects accumulated since the last call."""
        out, self.effects = self.effects, Effects()
        return out

    @property
    @abstractmethod
    def engine_id(self) -> str:
        """The id readers use to name this engine as a holder."""

    @abstractmethod
    def grant(self, now: float, hold: HeldBlocks) -> object:
        """Hold ``hold``'s blocks on every rank; return the ticket for the reader."""

    @abstractmethod
    def step(self, now: float) -> None:
        """Process what the transports delivered, run timers, send what is due."""

    @abstractmethod
    def track(self, now: float, req: ReadJob) -> None:
        """``req`` entered this (reader) engine's scheduler."""

    @abstractmethod
    def try_read(self, now: float, req: ReadJob) -> ReadStart:
        """The scheduler picked ``req``: read its blocks if possible."""

    @abstractmethod
    def finish(self, now: float, req: ReadJob) -> None:
        """``req`` no longer needs the holder's blocks (used, failed or aborted)."""

    @abstractmethod
    def connected(
        self, now: float, ask: HandshakeAsk, metadata: dict[int, bytes], offset: float
    ) -> None:
        """A handshake succeeded; ``offset`` is holder clock minus reader clock."""

    @abstractmethod
    def connect_failed(self, now: float, ask: HandshakeAsk) -> None:
        """A handshake failed (holder dead or unreachable)."""

    @abstractmethod
    def next_timer(self) -> float | None:
        """Local time of the next step this side needs even if nothing arrives."""

    @abstractmethod
    def holder_live(self, rank: int) -> int:
        """Leases the holder rank still holds."""

    @abstractmethod
    def holder_deadline(self, rank: int, key: str) -> float | None:
        """The holder rank's current deadline for ``key`` (local clock), if live."""

    def reader_bound(self, now: float, rank: int, key: str) -> float | None:
        """The reader rank's lower bound on the holder's deadline (kvproto only)."""
        return None

    def release(self, now: float, hold: HeldBlocks) -> None:  # noqa: B027 (a no-op default)
        """A router says nobody will read ``hold`` (no path for it in vLLM's leases)."""

    @property
    def uses_fence(self) -> bool:
        """Whether loaded blocks are used only after the holder confirmed the lease."""
        return False

    def counters(self) -> dict[str, int]:
        """The policy's own counters, summed into ``RunResult.extra`` (none by default)."""
        return {}
