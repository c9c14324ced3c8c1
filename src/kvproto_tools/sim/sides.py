"""Policies as seen by one engine: the lease logic of all its ranks behind one interface.

A *side* owns an engine's holder and reader objects (one per TP rank) and
talks to the network only through the engine's :class:`SimTransport`
endpoints. The simulator calls it at the engine's step boundaries and
collects what happened as :class:`Effects`.

* :class:`KvprotoSide` runs the real core (:class:`kvproto.holder.Holder`,
  :class:`kvproto.reader.Reader`) through the project's binding
  (:class:`kvproto_binding.endpoint.Endpoint`), exactly as a deployment does.
* :class:`VllmSide` runs the restatement of vLLM 0.32.0's leases
  (:mod:`kvproto_tools.baselines.vllm_lease`); with heartbeats off it is vLLM
  before leases (one fixed timeout).
"""

from __future__ import annotations

import enum
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvproto.config import LeaseConfig
from kvproto.errors import RemoteProtocolError
from kvproto.events import ReadDeclined, ReadDeferred
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto.ticket import LeaseTicket
from kvproto.tpmath import expected_consumers, read_slices, target_remote_ranks
from kvproto.transport import (
    FrameTooLarge,
    PeerId,
    PeerUnreachable,
    ReadCompleted,
    ReadFailed,
    ReadId,
    Received,
    UnknownPeer,
)
from kvproto_binding.endpoint import Endpoint, StepResult
from kvproto_tools.baselines.vllm_lease import (
    VllmLeaseConfig,
    VllmLeaseHolder,
    VllmLeaseReader,
    completion_frame,
    turn2_read_allowed,
    worker_heartbeats,
)

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


@dataclass(frozen=True, slots=True, kw_only=True)
class BaselineTicket:
    """What vLLM's ``kv_transfer_params`` carry for one request."""

    engine_id: str
    """``remote_engine_id``."""
    request_id: str
    """``remote_request_id``."""
    tp: int
    """Holder TP size."""
    deadline: float
    """Lease deadline in the holder's clock (used by turn-2 reads)."""


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

    @property
    def uses_fence(self) -> bool:
        """Whether loaded blocks are used only after the holder confirmed the lease."""
        return False

    def counters(self) -> dict[str, int]:
        """The policy's own counters, summed into ``RunResult.extra`` (none by default)."""
        return {}


# --------------------------------------------------------------------------- kvproto


def _entropy(seed: str) -> Callable[[int], bytes]:
    rng = random.Random(seed)
    return rng.randbytes


class KvprotoSide(Side):
    """The real core, one Holder and one Reader per rank, behind the project's binding."""

    def __init__(
        self,
        transports: list[SimTransport],
        name: str,
        incarnation: int,
        config: LeaseConfig,
        seed: str,
    ) -> None:
        super().__init__(transports, name, incarnation)
        self.config = config
        self.renew_extension = config.lease_extension
        self.holders: list[Holder] = []
        self.readers: list[Reader] = []
        self.bindings: list[Endpoint] = []
        for rank, tr in enumerate(transports):
            holder = Holder(
                config,
                engine=name,
                incarnation=incarnation,
                rank=rank,
                tp_size=self.tp,
                entropy=_entropy(f"{seed}/h{rank}"),
            )
            reader = Reader(
                config,
                engine=name,
                incarnation=incarnation,
                rank=rank,
                tp_size=self.tp,
                entropy=_entropy(f"{seed}/r{rank}"),
            )
            self.holders.append(holder)
            self.readers.append(reader)
            self.bindings.append(Endpoint(tr, holder=holder, reader=reader))
        self._lease_of: dict[str, int] = {}
        self._reading: dict[str, set[int]] = {}
        """Request → reader ranks whose reads started while another rank's was deferred."""

    @property
    def engine_id(self) -> str:
        return self.name

    @property
    def uses_fence(self) -> bool:
        return True

    def grant(self, now: float, hold: HeldBlocks) -> object:
        ticket = self.holders[0].grant(now, request_id=hold.key, ttl=hold.ttl)
        for holder in self.holders[1:]:
            holder.adopt(now, ticket)  # vLLM: the scheduler mints, every worker adopts
        self._lease_of[hold.key] = ticket.lease
        return ticket

    def _absorb(self, rank: int, res: StepResult) -> None:
        fx = self.effects
        for fb in res.freed:
            fx.freed.append((rank, fb.request_id, fb.reason.name.lower().replace("_", "-")))
        for rf in res.failed:
            fx.failed.append((rf.request_id, rf.reason.value))
        for rid in res.confirmed:
            fx.usable.append((rid, rank))
        for c in res.connects:
            fx.asks.append(HandshakeAsk(rank=rank, engine_id=c.engine, holder_ranks=(c.rank,)))

    def step(self, now: float) -> None:
        for rank, binding in enumerate(self.bindings):
            self._absorb(rank, binding.step(now))

    def track(self, now: float, req: ReadJob) -> None:
        ticket = req.hold.ticket
        assert isinstance(ticket, LeaseTicket)
        for rank, reader in enumerate(self.readers):
            reader.track(now, request_id=req.key, ticket=ticket)
            self._absorb(rank, self.bindings[rank].step(now))

    def try_read(self, now: float, req: ReadJob) -> ReadStart:
        if not all(reader.ready_to_read(req.key) for reader in self.readers):
            return ReadStart.WAIT
        assert req.local_blocks is not None
        # Each rank decides on its own (as vLLM's workers do): a rank whose read was
        # deferred is asked again at later steps, the ranks that started are not.
        started = self._reading.setdefault(req.key, set())
        deferred = False
        for rank, binding in enumerate(self.bindings):
            if rank in started:
                continue
            tr = self.transports[rank]
            tr.context = req
            try:
                decision = binding.start_read(
                    now, req.key, local_blocks=req.local_blocks, remote_blocks=req.hold.blocks
                )
            finally:
                tr.context = None
            self._absorb(rank, binding.step(now))
            if isinstance(decision, ReadDeclined):
                self._reading.pop(req.key, None)
                return ReadStart.DECLINED
            if isinstance(decision, ReadDeferred):
                deferred = True
            else:
                started.add(rank)
        if deferred:
            return ReadStart.WAIT
        self._reading.pop(req.key, None)
        return ReadStart.STARTED

    def finish(self, now: float, req: ReadJob) -> None:
        self._reading.pop(req.key, None)
        for rank, reader in enumerate(self.readers):
            reader.finish(now, req.key)  # a rank that dropped it already counts a no-op
            self._absorb(rank, self.bindings[rank].step(now))

    def connected(
        self, now: float, ask: HandshakeAsk, metadata: dict[int, bytes], offset: float
    ) -> None:
        binding = self.bindings[ask.rank]
        for holder_rank, meta in metadata.items():
            # A session that broke while connecting stays broken (the reader counts it).
            binding.connected(now, engine=ask.engine_id, rank=holder_rank, metadata=meta)
        self._absorb(ask.rank, binding.step(now))

    def connect_failed(self, now: float, ask: HandshakeAsk) -> None:
        binding = self.bindings[ask.rank]
        for holder_rank in ask.holder_ranks:
            binding.connect_failed(now, engine=ask.engine_id, rank=holder_rank)
        self._absorb(ask.rank, binding.step(now))

    def next_timer(self) -> float | None:
        due = [d for b in self.bindings if (d := b.next_deadline()) is not None]
        return min(due) if due else None

    def holder_live(self, rank: int) -> int:
        return self.holders[rank].live_leases()

    def holder_deadline(self, rank: int, key: str) -> float | None:
        lease = self._lease_of.get(key)
        return None if lease is None else self.holders[rank].live_deadline(lease)

    def reader_bound(self, now: float, rank: int, key: str) -> float | None:
        reader = self.readers[rank]
        return reader.deadline_bound(now, key) if reader.is_tracked(key) else None


# --------------------------------------------------------------------------- vLLM


class VllmSide(Side):
    """vLLM 0.32.0's leases (or, with heartbeats off, vLLM before leases)."""

    def __init__(
        self,
        transports: list[SimTransport],
        name: str,
        incarnation: int,
        config: VllmLeaseConfig,
    ) -> None:
        super().__init__(transports, name, incarnation)
        self.config = config
        self.renew_extension = float(config.extension) if config.heartbeats else None
        self.holders = [VllmLeaseHolder(config) for _ in transports]
        self.reader = VllmLeaseReader(config)
        # Worker state per rank: holder engine id -> {holder rank: peer}.
        self._peers: list[dict[str, dict[int, PeerId]]] = [{} for _ in transports]
        self._pending: list[dict[str, None]] = [{} for _ in transports]
        self._offset: dict[str, float] = {}
        self._engine_tp: dict[str, int] = {}
        self._reads: list[dict[ReadId, str]] = [{} for _ in transports]
        self._waiting_on: dict[str, dict[str, None]] = {}
        self._outstanding: dict[tuple[str, int], int] = {}
        self.malformed = 0
        """Notifications that would have raised out of vLLM's get_finished()."""
        self.send_errors = 0
        """Sends the transport refused (vLLM logs them)."""

    @property
    def engine_id(self) -> str:
        return f"{self.name}.{self.incarnation}"  # vLLM engine ids are per process

    def grant(self, now: float, hold: HeldBlocks) -> object:
        deadline = now + hold.ttl
        for holder in self.holders:
            deadline = holder.grant(now, hold.key, ttl=hold.ttl)
        return BaselineTicket(
            engine_id=self.engine_id, request_id=hold.key, tp=self.tp, deadline=deadline
        )

    def step(self, now: float) -> None:
        fx = self.effects
        for rank, tr in enumerate(self.transports):
            for ev in tr.poll():
                if isinstance(ev, Received):
                    try:
                        self.holders[rank].handle_notification(now, ev.payload)
                    except RemoteProtocolError:
                        self.malformed += 1
                elif isinstance(ev, ReadCompleted):
                    self._read_done(rank, ev.read_id, ok=True)
                elif isinstance(ev, ReadFailed):
                    self._read_done(rank, ev.read_id, ok=False)
                # PeerLost: vLLM 0.32 does nothing with it (leases run out).
            holder = self.holders[rank]
            for key in holder.get_finished(now):
                fx.freed.append((rank, key, "expired" if key in holder.last_expired else "done"))
        meta = self.reader.build_meta(now)
        if meta is None:
            return
        for rank, tr in enumerate(self.transports):
            frames, need = worker_heartbeats(meta, self._peers[rank])
            for engine_id in need:
                self._ask(rank, engine_id)
            for engine_id, payload in frames:
                for peer in self._peers[rank][engine_id].values():
                    self._send(tr, peer, payload)

    def _send(self, tr: SimTransport, peer: PeerId, payload: bytes) -> None:
        try:
            tr.send(peer, payload)
        except (PeerUnreachable, UnknownPeer, FrameTooLarge):
            self.send_errors += 1

    def _read_done(self, rank: int, read_id: ReadId, *, ok: bool) -> None:
        key = self._reads[rank].pop(read_id, None)
        if key is None:
            return
        if not ok:
            self.effects.failed.append((key, "read-failed"))
            self._outstanding.pop((key, rank), None)
            return
        left = self._outstanding.get((key, rank), 0) - 1
        if left > 0:
            self._outstanding[(key, rank)] = left
        else:
            self._outstanding.pop((key, rank), None)
            self.effects.usable.append((key, rank))

    def _ask(self, rank: int, engine_id: str) -> None:
        if engine_id in self._pending[rank]:
            return
        self._pending[rank][engine_id] = None
        tp = self._engine_tp[engine_id]
        ranks = tuple(target_remote_ranks(rank, self.tp, tp))
        self.effects.asks.append(HandshakeAsk(rank=rank, engine_id=engine_id, holder_ranks=ranks))

    def track(self, now: float, req: ReadJob) -> None:
        ticket = req.hold.ticket
        assert isinstance(ticket, BaselineTicket)
        self._engine_tp[ticket.engine_id] = ticket.tp
        if req.turn == 1:  # turn-2 blocks have a fixed TTL: nobody heartbeats them
            self.reader.on_new_request(ticket.request_id, ticket.engine_id)

    def try_read(self, now: float, req: ReadJob) -> ReadStart:
        ticket = req.hold.ticket
        assert isinstance(ticket, BaselineTicket)
        if req.turn == 2:
            offset = self._offset.get(ticket.engine_id, 0.0) if self.config.clock_sync else 0.0
            if not turn2_read_allowed(
                now, ticket.deadline, offset=offset, margin=self.config.turn2_margin
            ):
                self.effects.failed.append((req.key, "turn2-expired"))
                return ReadStart.DECLINED
        ready = True
        for rank in range(self.tp):
            if ticket.engine_id not in self._peers[rank]:
                self._ask(rank, ticket.engine_id)
                ready = False
        if not ready:
            self._waiting_on.setdefault(ticket.engine_id, {})[req.key] = None
            return ReadStart.WAIT
        assert req.local_blocks is not None
        self._waiting_on.get(ticket.engine_id, {}).pop(req.key, None)
        notify = completion_frame(ticket.request_id, expected_consumers(ticket.tp, self.tp))
        for rank, tr in enumerate(self.transports):
            targets = target_remote_ranks(rank, self.tp, ticket.tp)
            self._outstanding[(req.key, rank)] = len(targets)
            for holder_rank in targets:
                local_slice, remote_slice = read_slices(rank, self.tp, ticket.tp, holder_rank)
                peer = self._peers[rank][ticket.engine_id][holder_rank]
                tr.context = req
                try:
                    read_id = tr.read_blocks(
                        peer,
                        local_blocks=req.local_blocks,
                        remote_blocks=req.hold.blocks,
                        local_slice=local_slice,
                        remote_slice=remote_slice,
                        notify=notify,
                    )
                except (PeerUnreachable, UnknownPeer):
                    self.effects.failed.append((req.key, "read-refused"))
                    return ReadStart.STARTED
                finally:
                    tr.context = None
                self._reads[rank][read_id] = req.key
        return ReadStart.STARTED

    def finish(self, now: float, req: ReadJob) -> None:
        ticket = req.hold.ticket
        assert isinstance(ticket, BaselineTicket)
        self.reader.stop(ticket.request_id)

    def connected(
        self, now: float, ask: HandshakeAsk, metadata: dict[int, bytes], offset: float
    ) -> None:
        self._pending[ask.rank].pop(ask.engine_id, None)
        tr = self.transports[ask.rank]
        self._peers[ask.rank][ask.engine_id] = {
            r: tr.add_peer(meta) for r, meta in metadata.items()
        }
        self._offset[ask.engine_id] = offset

    def connect_failed(self, now: float, ask: HandshakeAsk) -> None:
        # Only logged on the heartbeat path (the next tick asks again); requests
        # waiting to read from this engine fail and are recomputed.
        self._pending[ask.rank].pop(ask.engine_id, None)
        for key in self._waiting_on.pop(ask.engine_id, {}):
            self.effects.failed.append((key, "handshake-failed"))

    def next_timer(self) -> float | None:
        due = [d for h in self.holders if (d := h.next_due()) is not None]
        hb = self.reader.next_heartbeat()
        if hb is not None:
            due.append(hb)
        return min(due) if due else None

    def holder_live(self, rank: int) -> int:
        return len(self.holders[rank])

    def holder_deadline(self, rank: int, key: str) -> float | None:
        return self.holders[rank].deadline(key)

    def counters(self) -> dict[str, int]:
        """What vLLM 0.32 itself would have exported (``vllm:nixl_num_*``), all ranks."""
        return {
            "vllm_num_kv_expired_reqs": sum(h.stats.expired for h in self.holders),
            "vllm_num_notifications_after_expiry": sum(
                h.stats.notifications_after_expiry for h in self.holders
            ),
        }

    def peers_known(self, rank: int, engine_id: str) -> bool:
        """Whether the rank has handshaken with ``engine_id``."""
        return engine_id in self._peers[rank]


def inf_to_none(value: float) -> float | None:
    """None for an infinite value (a timer that never fires)."""
    return None if math.isinf(value) else value
