"""vLLM's side: the restatement of vLLM 0.32.0's leases (or, heartbeats off, vLLM before leases).

The lease rules are :mod:`kvproto_tools.baselines.vllm_lease`; this module
plays vLLM's workers around them: handshakes, heartbeats per worker, reads
per holder rank, and the counters vLLM itself exports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvproto.errors import RemoteProtocolError
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
from kvproto_tools.baselines.vllm_lease import (
    VllmLeaseConfig,
    VllmLeaseHolder,
    VllmLeaseReader,
    completion_frame,
    turn2_read_allowed,
    worker_heartbeats,
)
from kvproto_tools.sim.sides import HandshakeAsk, HeldBlocks, ReadJob, ReadStart, Side

if TYPE_CHECKING:
    from kvproto_tools.sim.transport import SimTransport


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
