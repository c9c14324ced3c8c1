"""The simulator's view of one engine rank's loopback endpoint.

:class:`SimTransport` is a :class:`kvproto.transport.Transport` that forwards
everything to a real :class:`~kvproto_transports.loopback.LoopbackTransport`
except ``poll``: the simulator drains the real endpoint the instant the
network delivers (so it knows exactly when a read copied its data) and hands
the events to the engine at its next step boundary, as vLLM's step loop sees
them. It also counts heartbeat traffic and records every read it issues.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvproto import wire
from kvproto.tpmath import BlockSlice
from kvproto.transport import (
    PeerId,
    PeerLost,
    PeerUnreachable,
    ReadCompleted,
    ReadFailed,
    ReadId,
    Received,
    TransportError,
    TransportEvent,
    UnknownPeer,
)
from kvproto_binding.step import frame_tag
from kvproto_transports.forwarding import ForwardingTransport
from kvproto_transports.loopback import LoopbackTransport

if TYPE_CHECKING:
    from kvproto_tools.sim.agenda import Agenda

HEARTBEAT_TAGS = frozenset({3, 4})
"""kvproto Heartbeat and HeartbeatAck: the keep-alive traffic."""


def heartbeat_kind(payload: bytes) -> int:
    """1 for a kvproto Heartbeat or stock ``HB:`` frame, 2 for a HeartbeatAck, else 0."""
    if payload.startswith(b"HB:"):
        return 1
    tag = frame_tag(payload)
    if tag == wire.Heartbeat.__struct_config__.tag:
        return 1
    if tag == wire.HeartbeatAck.__struct_config__.tag:
        return 2
    return 0


@dataclass(frozen=True, slots=True, kw_only=True)
class _PendingRead:
    """A read handed to the network after its rank's skew."""

    handle: ReadId
    peer: PeerId
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    local_slice: BlockSlice
    remote_slice: BlockSlice
    notify: bytes | None


class RankHost(Protocol):
    """What an endpoint reports to the simulator (all at the current global time)."""

    def heartbeat_sent(self, nbytes: int) -> None:
        """A heartbeat (or its ack) of ``nbytes`` left an endpoint."""

    def heartbeat_seen(self, tr: SimTransport, peer: PeerId) -> None:
        """``tr``'s rank is about to process a heartbeat from ``peer``."""

    def read_issued(self, tr: SimTransport, handle: ReadId, peer: PeerId, job: object) -> None:
        """``tr`` issued read ``handle`` from ``peer`` for ``job`` (the side's :attr:`context`)."""

    def delivered(self, tr: SimTransport, events: list[TransportEvent]) -> None:
        """Events for ``tr``'s rank, to be handled at its engine's next step."""


class SimTransport(ForwardingTransport[LoopbackTransport]):
    """One rank's endpoint as the engine's side sees it; what it does not override goes to
    the real endpoint unchanged."""

    def __init__(
        self,
        host: RankHost,
        clock: Agenda,
        rank: int,
        real: LoopbackTransport,
        *,
        skew: float,
        seed: str,
    ) -> None:
        super().__init__(real)
        self.host = host
        self.clock = clock
        self.rank = rank
        self.skew = skew
        """A read is handed to the network up to this long after it is issued, seconds."""
        self.inbox: list[TransportEvent] = []
        """Events delivered by the network, waiting for the engine's next step."""
        self.context: object | None = None
        """The request whose reads are being issued (set by the side around read calls)."""
        self.disturbed = False
        """A peer was lost (or a send failed) since the oracles last looked: deadlines may drop."""
        self._next_id = 0
        self._handles: dict[ReadId, ReadId] = {}
        self._rng = random.Random(f"{seed}/skew/{real.local_peer}")

    @property
    def real(self) -> LoopbackTransport:
        """The real loopback endpoint (:attr:`inner`), in the simulator's words."""
        return self.inner

    # --- traffic ------------------------------------------------------------------------
    def send(self, peer: PeerId, payload: bytes) -> None:
        kind = heartbeat_kind(payload)
        if kind:
            self.host.heartbeat_sent(len(payload))
        try:
            self.real.send(peer, payload)
        except (PeerUnreachable, UnknownPeer):
            self.disturbed = True
            raise

    def poll(self) -> Sequence[TransportEvent]:
        events, self.inbox = self.inbox, []
        for ev in events:
            if isinstance(ev, Received):
                if heartbeat_kind(ev.payload) == 1:
                    self.host.heartbeat_seen(self, ev.peer)
            elif isinstance(ev, PeerLost):
                self.disturbed = True
        return events

    def read_blocks(
        self,
        peer: PeerId,
        *,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        local_slice: BlockSlice = BlockSlice.FULL,
        remote_slice: BlockSlice = BlockSlice.FULL,
        notify: bytes | None = None,
    ) -> ReadId:
        # TP workers are separate processes: each issues its transfer when it
        # reaches start_load_kv, not in lockstep with its siblings. The read is
        # handed to the network after a small per-read skew; the caller gets a
        # handle at once, as from a real asynchronous transfer API.
        self._next_id += 1
        handle = self._next_id
        pending = _PendingRead(
            handle=handle,
            peer=peer,
            local_blocks=tuple(local_blocks),
            remote_blocks=tuple(remote_blocks),
            local_slice=local_slice,
            remote_slice=remote_slice,
            notify=notify,
        )
        if self.context is not None:
            self.host.read_issued(self, handle, peer, self.context)
        delay = self._rng.uniform(0.0, self.skew)
        self.clock.at(self.clock.t + delay, lambda: self._issue(pending))
        return handle

    def _issue(self, p: _PendingRead) -> None:
        if not self.real.alive:
            return  # the issuing process died first
        try:
            real_id = self.real.read_blocks(
                p.peer,
                local_blocks=p.local_blocks,
                remote_blocks=p.remote_blocks,
                local_slice=p.local_slice,
                remote_slice=p.remote_slice,
                notify=p.notify,
            )
        except TransportError as exc:
            self.host.delivered(self, [ReadFailed(read_id=p.handle, reason=str(exc))])
            return
        self._handles[real_id] = p.handle

    def take_network_events(self) -> list[TransportEvent]:
        """What the real endpoint delivered, with read ids translated to our handles."""
        out: list[TransportEvent] = []
        for ev in self.real.poll():
            if isinstance(ev, ReadCompleted):
                out.append(ReadCompleted(read_id=self._handles.pop(ev.read_id)))
            elif isinstance(ev, ReadFailed):
                out.append(ReadFailed(read_id=self._handles.pop(ev.read_id), reason=ev.reason))
            else:
                out.append(ev)
        return out
