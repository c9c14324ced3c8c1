"""kvproto's side: the real core, one Holder and one Reader per rank, behind the binding.

:class:`kvproto.holder.Holder` and :class:`kvproto.reader.Reader` run through
:class:`kvproto_binding.step.Binding` over the engine's simulated
endpoints, exactly as a deployment runs them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvproto.config import LeaseConfig
from kvproto.events import ReadDeclined, ReadDeferred
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto.ticket import LeaseTicket
from kvproto_binding.step import Binding, StepResult
from kvproto_tools.sim.sides import HandshakeAsk, HeldBlocks, ReadJob, ReadStart, Side

if TYPE_CHECKING:
    from kvproto_tools.sim.transport import SimTransport


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
        self.bindings: list[Binding] = []
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
            self.bindings.append(Binding(tr, holder=holder, reader=reader))
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

    def release(self, now: float, hold: HeldBlocks) -> None:
        lease = self._lease_of.get(hold.key)
        if lease is None:
            return
        for rank, holder in enumerate(self.holders):
            holder.revoke(now, lease)
            self._absorb(rank, self.bindings[rank].step(now))

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
