"""One loopback endpoint: :class:`kvproto.transport.Transport`, exactly.

All traffic goes through the owning :class:`~.network.LoopbackNetwork`,
which decides latency, loss and order and fires events when the simulated
clock reaches them. The endpoint itself only validates calls, keeps its
inbox, its peer table and its memory.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from kvproto.errors import LocalProtocolError
from kvproto.tpmath import BlockLayout, BlockSlice
from kvproto.transport import (
    BadMetadata,
    Capabilities,
    FrameTooLarge,
    MemoryNotRegistered,
    PeerId,
    PeerUnreachable,
    ReadId,
    ThreadAffinity,
    TransportClosed,
    TransportEvent,
    UnknownPeer,
)
from kvproto_transports.loopback.memory import Memory
from kvproto_transports.loopback.stats import Counters, LoopbackStats
from kvproto_transports.transfers import Transfers, outcome

if TYPE_CHECKING:
    from kvproto_transports.loopback.network import LoopbackNetwork

DEFAULT_MAX_NOTIFICATION_SIZE = 4096
"""Loopback's default notification cap: small enough that splitting is exercised."""


class _Metadata(msgspec.Struct, frozen=True):
    transport: str
    net: str
    peer: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingRead:
    """A read (or a write) in flight, as the network needs it at completion time."""

    read_id: ReadId
    """The issuer's handle."""
    reader: LoopbackTransport
    """The endpoint that issued the transfer (a read's data lands here, a write's leaves)."""
    holder: PeerId
    """The peer whose memory is read (or written)."""
    local_blocks: tuple[int, ...]
    """The issuer's blocks, one per remote block."""
    remote_blocks: tuple[int, ...]
    """The peer's blocks."""
    local_slice: BlockSlice
    """Which part of each local block moves."""
    remote_slice: BlockSlice
    """Which part of each remote block moves."""
    notify: bytes | None
    """Sent to the peer after the data is copied."""
    write: bool = False
    """A WRITE: the data goes from the issuer's memory into the peer's."""


class LoopbackTransport(Transfers):
    """An in-process endpoint on a :class:`~.network.LoopbackNetwork`.

    Create it with ``net.endpoint(name)``; its ``local_peer`` is
    ``"<name>#<incarnation>"``. Besides the Transport protocol it offers
    :meth:`allocate_layout`, :meth:`write_block` and :meth:`read_block` so
    tests can put real bytes in memory and look at them.
    """

    def __init__(
        self,
        net: LoopbackNetwork,
        base_name: str,
        incarnation: int,
        max_notification_size: int | None,
    ) -> None:
        if max_notification_size is not None and max_notification_size < 1:
            raise ValueError("max_notification_size must be positive or None")
        self._net = net
        self._base = base_name
        self._incarnation = incarnation
        self._peer_id = f"{base_name}#{incarnation}"
        self._max = max_notification_size
        self._state = "open"
        self._inbox: list[TransportEvent] = []
        self._peers: dict[PeerId, bool] = {}  # peer -> already reported lost
        self._memory: Memory | None = Memory()
        self._layout: BlockLayout | None = None
        self._read_ids = itertools.count(1)
        self.counters = Counters()
        """This incarnation's traffic counters (the network keeps the totals)."""

    # --- identity ------------------------------------------------------------

    @property
    def name(self) -> str:
        """Always ``"loopback"``."""
        return "loopback"

    @property
    def base_name(self) -> str:
        """The name given to ``net.endpoint``; shared by every incarnation."""
        return self._base

    @property
    def incarnation(self) -> int:
        """Starts at the value given to ``net.endpoint``; ``net.restart`` adds one."""
        return self._incarnation

    @property
    def local_peer(self) -> PeerId:
        """``"<name>#<incarnation>"``: stable for this incarnation, new after a restart."""
        return self._peer_id

    @property
    def alive(self) -> bool:
        """Neither closed nor crashed."""
        return self._state == "open"

    @property
    def max_notification_size(self) -> int | None:
        """The cap ``send`` enforces."""
        return self._max

    @property
    def capabilities(self) -> Capabilities:
        """Computed from the network's *current* faults on links touching this endpoint.

        Fault injection exists to break promises on purpose, so the declaration
        follows it: a link with ``reorder > 0`` makes the endpoint unordered,
        one with ``duplicate > 0`` makes it duplicating.
        """
        return Capabilities(
            max_notification_size=self._max,
            ordered=not self._net.any_fault(self._base, "reorder"),
            may_duplicate=self._net.any_fault(self._base, "duplicate"),
            detects_peer_failure=True,
            failure_detection_bound_s=self._net.detection_delay,
            one_sided_reads=False,
            thread_affinity=ThreadAffinity.OWNER,
            writes=True,
        )

    @property
    def stats(self) -> LoopbackStats:
        """A snapshot of this incarnation's counters."""
        return self.counters.snapshot()

    def _check_open(self) -> None:
        if self._state != "open":
            raise TransportClosed(f"{self.local_peer} is {self._state}")

    # --- peers -----------------------------------------------------------------

    def metadata(self) -> bytes:
        """A registry key on this network: JSON naming the network and this incarnation."""
        self._check_open()
        return msgspec.json.encode(
            _Metadata(transport="loopback", net=self._net.token, peer=self.local_peer)
        )

    def add_peer(self, metadata: bytes) -> PeerId:
        """Resolve ``metadata`` on this network; returns the peer's ``local_peer``."""
        self._check_open()
        try:
            meta = msgspec.json.decode(metadata, type=_Metadata)
        except (msgspec.DecodeError, TypeError) as exc:
            raise BadMetadata(f"not loopback metadata: {exc}") from exc
        if meta.transport != "loopback" or meta.net != self._net.token:
            raise BadMetadata(f"metadata of another network ({meta.net})")
        if not self._net.knows_peer(meta.peer):
            raise BadMetadata(f"no endpoint {meta.peer!r} on this network")
        if meta.peer not in self._peers:
            self._peers[meta.peer] = False
            self._net.watch(self, meta.peer)
        return meta.peer

    def remove_peer(self, peer: PeerId) -> None:
        """Forget ``peer``; a pending loss report about it is dropped too."""
        self._check_open()
        self._peers.pop(peer, None)

    def knows(self, peer: PeerId) -> bool:
        """Whether ``peer`` was added and not removed (used by the network)."""
        return peer in self._peers

    def mark_lost(self, peer: PeerId) -> bool:
        """Record that ``peer`` is lost; False if already recorded or not a peer."""
        if self._peers.get(peer, True):
            return False
        self._peers[peer] = True
        return True

    # --- notifications -----------------------------------------------------------

    def send(self, peer: PeerId, payload: bytes) -> None:
        """Queue one notification on the link to ``peer``; returns at once."""
        self._check_open()
        data = bytes(payload)  # a copy: later changes by the caller must not travel
        if self._max is not None and len(data) > self._max:
            raise FrameTooLarge(f"{len(data)} bytes > max_notification_size {self._max}")
        lost = self._peers.get(peer)
        if lost is None:
            raise UnknownPeer(peer)
        if lost:
            raise PeerUnreachable(f"{peer} was reported lost")
        self._net.transmit(self, peer, data)

    def poll(self) -> Sequence[TransportEvent]:
        """Everything delivered since the last call, in the order it happened."""
        self._check_open()
        events, self._inbox = self._inbox, []
        return events

    def deliver(self, event: TransportEvent) -> None:
        """Put an event in the inbox (used by the network)."""
        self._inbox.append(event)

    # --- memory --------------------------------------------------------------------

    def allocate_layout(
        self,
        num_regions: int,
        block_len: int,
        num_blocks: int,
        *,
        device_id: int = 0,
        memory_kind: str = "DRAM",
    ) -> BlockLayout:
        """Back ``num_regions`` regions of ``num_blocks`` zeroed blocks; not yet registered."""
        self._check_open()
        assert self._memory is not None
        addrs = []
        for _ in range(num_regions):
            addr = self._net.addresses.take(block_len * num_blocks)
            self._memory.add_region(addr, block_len, num_blocks)
            addrs.append(addr)
        return BlockLayout(
            region_addrs=tuple(addrs),
            block_lens=(block_len,) * num_regions,
            num_blocks=num_blocks,
            device_id=device_id,
            memory_kind=memory_kind,
        )

    def register_blocks(self, layout: BlockLayout) -> None:
        """Register ``layout``; regions it names that were never allocated are backed lazily.

        A later call replaces the registered layout.
        """
        self._check_open()
        assert self._memory is not None
        self._memory.adopt(layout)
        self._layout = layout

    @property
    def layout(self) -> BlockLayout | None:
        """The registered layout, if any."""
        return self._layout

    def _resolve(self, layout: BlockLayout | None, region: int) -> tuple[Memory, int]:
        self._check_open()
        assert self._memory is not None
        layout = layout or self._layout
        if layout is None:
            raise MemoryNotRegistered(f"{self.local_peer} has no layout")
        if not 0 <= region < layout.num_regions:
            raise MemoryNotRegistered(f"region {region} outside 0..{layout.num_regions - 1}")
        return self._memory, layout.region_addrs[region]

    def write_block(
        self,
        region: int,
        block: int,
        data: bytes,
        *,
        layout: BlockLayout | None = None,
        offset: int = 0,
    ) -> None:
        """Test helper: write ``data`` into one block (of the registered layout by default)."""
        memory, addr = self._resolve(layout, region)
        memory.write(addr, block, offset, bytes(data))

    def read_block(self, region: int, block: int, *, layout: BlockLayout | None = None) -> bytes:
        """Test helper: the current bytes of one whole block."""
        memory, addr = self._resolve(layout, region)
        lay = layout or self._layout
        assert lay is not None
        return memory.read(addr, block, 0, lay.block_lens[region])

    def memory(self) -> tuple[Memory, BlockLayout] | None:
        """Registered memory and layout for the network's copy, or None."""
        if self._memory is None or self._layout is None:
            return None
        return self._memory, self._layout

    # --- reads ---------------------------------------------------------------------

    def _transfer(
        self,
        peer: PeerId,
        *,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        local_slice: BlockSlice,
        remote_slice: BlockSlice,
        notify: bytes | None,
        write: bool,
    ) -> ReadId:
        """Issue one read or write; the data is copied when the simulated clock reaches its
        completion (a write's into the peer's memory, then ``notify`` leaves).

        Local mistakes raise at once (:class:`MemoryNotRegistered`,
        :class:`FrameTooLarge`, :class:`UnknownPeer`); anything that depends on the peer
        (its layout, its liveness, the link) ends in ReadFailed or WriteFailed; a dead or
        cut-off peer, or a dead issuer, lands nothing.
        """
        self._check_open()
        if len(local_blocks) != len(remote_blocks):
            raise LocalProtocolError(
                f"{len(local_blocks)} local blocks for {len(remote_blocks)} remote blocks"
            )
        if notify is not None:
            notify = bytes(notify)
            if self._max is not None and len(notify) > self._max:
                raise FrameTooLarge(f"notify of {len(notify)} bytes > {self._max}")
        lost = self._peers.get(peer)
        if lost is None:
            raise UnknownPeer(peer)
        if local_blocks:
            self._check_local(local_blocks, local_slice)
        read = PendingRead(
            read_id=next(self._read_ids),
            reader=self,
            holder=peer,
            local_blocks=tuple(local_blocks),
            remote_blocks=tuple(remote_blocks),
            local_slice=local_slice,
            remote_slice=remote_slice,
            notify=notify,
            write=write,
        )
        self.counters.reads_started += 1
        self._net.counters.reads_started += 1
        if lost:
            self.fail_read(read, f"{peer} was reported lost")
        else:
            self._net.start_read(read)
        return read.read_id

    def _check_local(self, blocks: Sequence[int], local_slice: BlockSlice) -> None:
        if self._layout is None:
            raise MemoryNotRegistered(f"{self.local_peer} registered no memory")
        for b in blocks:
            if not 0 <= b < self._layout.num_blocks:
                raise MemoryNotRegistered(
                    f"local block {b} outside 0..{self._layout.num_blocks - 1}"
                )
        for block_len in self._layout.block_lens:
            local_slice.span(block_len)  # raises if the slice does not divide the block

    def fail_read(self, read: PendingRead, reason: str) -> None:
        """Report a failed read or write (used by the network)."""
        self.counters.reads_failed += 1
        self._net.counters.reads_failed += 1
        self._inbox.append(outcome(read.read_id, write=read.write, failed=reason))

    # --- lifecycle -----------------------------------------------------------------

    def close(self) -> None:
        """Leave the network; peers that know this endpoint learn of it as PeerLost."""
        if self._state != "open":
            return
        self._die("closed")

    def _die(self, state: str, detection_delay: float | None = None) -> None:
        # Whatever the reason, the endpoint's memory and queues are gone at
        # once: a crashed process keeps nothing, and a closed one must not be
        # readable any more (its memory may be reused).
        self._state = state
        self._memory = None
        self._layout = None
        self._inbox.clear()
        self._peers.clear()
        self._net.departed(self, state, detection_delay)

    def crash(self, *, detection_delay: float | None = None) -> None:
        """Die as if by ``kill -9`` (use ``net.crash(name)``); no-op if already dead."""
        if self._state == "open":
            self._die("crashed", detection_delay)

    def __repr__(self) -> str:
        return f"<LoopbackTransport {self.local_peer} {self._state}>"
