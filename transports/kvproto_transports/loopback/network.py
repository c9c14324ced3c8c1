"""The loopback network: a deterministic, clock-injected wire between endpoints.

Nothing here reads a clock. Time only moves when the owner calls
``advance(now)``; everything due by then happens, in time order, ties broken
by the order in which it was scheduled. A discrete-event simulator asks
``next_event_time()`` and jumps straight there.

Semantics (what tests and the simulator may rely on):

* ``send`` stamps a message with ``net.now``. Its fate (drop, latency,
  reorder, duplicate) is decided at once by the link's seeded dice.
  Without ``reorder`` a link is FIFO whatever its jitter.
* A partition drops what is sent across it and what is in flight when it
  arrives. It does not by itself produce PeerLost (only a death does).
* A read of ``n`` bytes completes after ``delay(reader->holder) +
  delay(holder->reader) + n / read_bandwidth``. At completion the data is
  copied from the holder's memory *as it is then*; ReadCompleted goes into the
  reader's inbox and the notify, if any, is then sent reader -> holder as a
  normal notification (subject to that link's faults), so the holder can
  never see it before the copy.
* A write (push mode) is the same transfer the other way: at completion the
  data is copied from the writer's memory into the peer's, WriteCompleted goes
  into the writer's inbox and the notify follows, so the peer sees it only
  after its memory holds the data. A writer that died first lands nothing.
* ``crash(name)`` kills an endpoint like ``kill -9``: its memory, inbox and
  pending reads are gone, messages to it are dropped, reads from it fail at
  completion, and every endpoint that had added it gets PeerLost after
  ``detection_delay``; after that, ``send`` to it raises PeerUnreachable.
  Messages it had already put on the wire are still delivered (they left it).
  ``close()`` is reported to peers the same way, with reason "closed".
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Literal

from kvproto.transport import PeerId, PeerLost, Received
from kvproto_transports.loopback.endpoint import (
    DEFAULT_MAX_NOTIFICATION_SIZE,
    LoopbackTransport,
    PendingRead,
)
from kvproto_transports.loopback.faults import PERFECT, LinkFaults, Links
from kvproto_transports.loopback.memory import AddressSpace, Memory
from kvproto_transports.loopback.stats import Counters, LoopbackStats
from kvproto_transports.transfers import outcome

_tokens = itertools.count(1)

FaultName = Literal["drop", "duplicate", "reorder", "delay", "jitter"]


def base_name(name: str) -> str:
    """``"P0#3"`` -> ``"P0"``; a base name is returned unchanged."""
    return name.split("#", 1)[0]


class LoopbackNetwork:
    """A virtual network of :class:`LoopbackTransport` endpoints, driven by ``advance``."""

    def __init__(
        self,
        seed: int = 0,
        *,
        detection_delay: float = 1.0,
        read_bandwidth: float | None = None,
        default_link: LinkFaults = PERFECT,
        start: float = 0.0,
    ) -> None:
        """
        Args:
            seed: makes every fault decision reproducible.
            detection_delay: seconds from a death to PeerLost at its peers;
                also the endpoints' declared ``failure_detection_bound_s``.
            read_bandwidth: bytes per second a read moves; None: reads cost
                only link latency.
            default_link: faults of every link not set with :meth:`set_link`.
            start: the initial value of :attr:`now`.
        """
        if detection_delay < 0:
            raise ValueError("detection_delay must be >= 0")
        if read_bandwidth is not None and read_bandwidth <= 0:
            raise ValueError("read_bandwidth must be positive or None")
        self.seed = seed
        self.detection_delay = detection_delay
        self.read_bandwidth = read_bandwidth
        self.links = Links(seed, default_link)
        """Every link's faults, dice and order."""
        self.token = f"net{next(_tokens)}"
        """Names this network in endpoint metadata, so foreign metadata is refused."""
        self.addresses = AddressSpace()
        """Virtual addresses for every endpoint's memory."""
        self.counters = Counters()
        """Totals over every endpoint (see :attr:`stats`)."""
        self._now = start
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._current: dict[str, LoopbackTransport] = {}
        self._all: dict[PeerId, LoopbackTransport] = {}
        self._cut: set[tuple[str, str]] = set()
        self.transfer_delay: Callable[[PendingRead], float] | None = None
        """Extra seconds a read or write takes on top of latency and bandwidth (fault
        injection: a slow write); None: none."""
        self.on_transfer: Callable[[PendingRead], None] | None = None
        """Called the instant a read's or write's data has been copied (an observer for
        simulators and tests: where and when bytes landed)."""

    # --- time ----------------------------------------------------------------------

    @property
    def now(self) -> float:
        """The last time advanced to (or the time of the event being fired)."""
        return self._now

    def next_event_time(self) -> float | None:
        """When the next scheduled event is due, or None if nothing is scheduled."""
        return self._queue[0][0] if self._queue else None

    def advance(self, now: float) -> None:
        """Fire every event due by ``now``, in order, then set :attr:`now` to ``now``."""
        if now < self._now:
            raise ValueError(f"time runs forward: {now} < {self._now}")
        queue = self._queue
        while queue and queue[0][0] <= now:
            when, _, fire = heapq.heappop(queue)
            self._now = max(self._now, when)
            fire()
        self._now = now

    def settle(self) -> float:
        """Advance until nothing is scheduled; returns the time reached."""
        while (t := self.next_event_time()) is not None:
            self.advance(max(t, self._now))
        return self._now

    def _at(self, when: float, fire: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (when, next(self._seq), fire))

    # --- endpoints ---------------------------------------------------------------------

    def endpoint(
        self,
        name: str,
        *,
        max_notification_size: int | None = DEFAULT_MAX_NOTIFICATION_SIZE,
        incarnation: int = 1,
    ) -> LoopbackTransport:
        """Create endpoint ``name`` (its ``local_peer`` is ``"<name>#<incarnation>"``)."""
        if not name or "#" in name:
            raise ValueError(f"endpoint name {name!r} must be non-empty and contain no '#'")
        old = self._current.get(name)
        if old is not None and old.alive:
            raise ValueError(f"endpoint {name!r} exists; crash or close it, or use restart()")
        ep = LoopbackTransport(self, name, incarnation, max_notification_size)
        if ep.local_peer in self._all:
            raise ValueError(f"{ep.local_peer} was already used; incarnations are never reused")
        self._current[name] = ep
        self._all[ep.local_peer] = ep
        return ep

    def current(self, name: str) -> LoopbackTransport | None:
        """The latest incarnation of ``name`` (alive or not), if any."""
        return self._current.get(base_name(name))

    @property
    def names(self) -> list[str]:
        """Base names of every endpoint ever created, in creation order."""
        return list(self._current)

    def knows_peer(self, peer: PeerId) -> bool:
        """Whether ``peer`` names an incarnation ever created on this network."""
        return peer in self._all

    def crash(self, name: str, *, detection_delay: float | None = None) -> None:
        """Kill the current incarnation of ``name`` like ``kill -9``; no-op if already dead.

        ``detection_delay`` overrides the network's for this death only (a peer
        that dies mid-send is noticed sooner than one that goes silent).
        """
        ep = self._current.get(base_name(name))
        if ep is None:
            raise KeyError(name)
        ep.crash(detection_delay=detection_delay)

    def restart(self, name: str) -> LoopbackTransport:
        """Crash ``name`` if alive and start its next incarnation (no peers, no memory)."""
        old = self._current.get(base_name(name))
        if old is None:
            raise KeyError(name)
        old.crash()
        return self.endpoint(
            old.base_name,
            max_notification_size=old.max_notification_size,
            incarnation=old.incarnation + 1,
        )

    def departed(
        self, ep: LoopbackTransport, reason: str, detection_delay: float | None = None
    ) -> None:
        """Called by an endpoint that crashed or closed: tell the peers that know it."""
        for other in self._current.values():
            if other is not ep and other.alive and other.knows(ep.local_peer):
                self._notice_loss(other, ep.local_peer, reason, detection_delay)

    def watch(self, observer: LoopbackTransport, peer: PeerId) -> None:
        """``observer`` added ``peer``; if it is already dead, report that in due time."""
        target = self._all[peer]
        if not target.alive:
            self._notice_loss(observer, peer, "crashed or closed before it was added")

    def _notice_loss(
        self, observer: LoopbackTransport, peer: PeerId, reason: str, delay: float | None = None
    ) -> None:
        def fire() -> None:
            if observer.alive and observer.mark_lost(peer):
                observer.counters.peers_lost += 1
                self.counters.peers_lost += 1
                observer.deliver(PeerLost(peer=peer, reason=reason))

        self._at(self._now + (self.detection_delay if delay is None else delay), fire)

    # --- links ---------------------------------------------------------------------

    @property
    def default_link(self) -> LinkFaults:
        """The faults of every link not set with :meth:`set_link`."""
        return self.links.default

    def set_link(self, a: str, b: str, faults: LinkFaults) -> None:
        """Set the faults of the directed link ``a -> b`` (base names or peer ids)."""
        self.links.set((base_name(a), base_name(b)), faults)

    def link(self, a: str, b: str) -> LinkFaults:
        """The faults now in force on ``a -> b``."""
        return self.links.get((base_name(a), base_name(b)))

    def partition(self, a: str, b: str) -> None:
        """Cut both directions between ``a`` and ``b``."""
        a, b = base_name(a), base_name(b)
        self._cut |= {(a, b), (b, a)}

    def heal(self, a: str, b: str) -> None:
        """Undo :meth:`partition` between ``a`` and ``b``."""
        a, b = base_name(a), base_name(b)
        self._cut -= {(a, b), (b, a)}

    def partitioned(self, a: str, b: str) -> bool:
        """Whether ``a -> b`` is cut."""
        return (base_name(a), base_name(b)) in self._cut

    def any_fault(self, name: str, fault: FaultName) -> bool:
        """Whether any link touching ``name`` (or the default) has ``fault`` switched on."""
        if getattr(self.default_link, fault) > 0:
            return True
        return any(getattr(f, fault) > 0 for (a, b), f in self.links.items() if name in (a, b))

    # --- notifications -----------------------------------------------------------------

    def transmit(self, src: LoopbackTransport, dst: PeerId, payload: bytes) -> None:
        """Put one notification from ``src`` on the wire to ``dst``."""
        src.counters.notifications_sent += 1
        self.counters.notifications_sent += 1
        target = self._all.get(dst)
        if target is None or not target.alive:
            self._count_drop(src)
            return
        key = (src.base_name, target.base_name)
        if key in self._cut:
            self._count_drop(src)
            return
        passage = self.links.passage(self._now, key, (src.local_peer, dst))
        if passage is None:
            self._count_drop(src)
            return
        when, reordered, copies = passage
        if reordered:
            src.counters.reordered += 1
            self.counters.reordered += 1
        if copies == 2:
            src.counters.duplicated += 1
            self.counters.duplicated += 1
        received = Received(peer=src.local_peer, payload=payload)
        for _ in range(copies):
            self._at(when, lambda: self._arrive(src, target, received))

    def _arrive(self, src: LoopbackTransport, dst: LoopbackTransport, msg: Received) -> None:
        if not dst.alive or (src.base_name, dst.base_name) in self._cut:
            self._count_drop(src)
            return
        dst.counters.delivered += 1
        self.counters.delivered += 1
        dst.deliver(msg)

    def _count_drop(self, src: LoopbackTransport) -> None:
        src.counters.dropped += 1
        self.counters.dropped += 1

    # --- reads ---------------------------------------------------------------------

    def start_read(self, read: PendingRead) -> None:
        """Schedule the completion of ``read`` after a round trip and its transfer time."""
        a, b = read.reader.base_name, base_name(read.holder)
        latency = self.link(a, b).delay + self.link(b, a).delay
        if self.read_bandwidth is not None:
            layout = read.reader.layout
            if layout is not None and read.local_blocks:
                span = sum(read.local_slice.span(n)[1] for n in layout.block_lens)
                latency += span * len(read.local_blocks) / self.read_bandwidth
        if self.transfer_delay is not None:
            latency += self.transfer_delay(read)
        self._at(self._now + latency, lambda: self._complete(read))

    def _complete(self, read: PendingRead) -> None:
        reader = read.reader
        if not reader.alive:
            return  # nobody left to tell; its memory is gone
        problem = self._check_read(read)
        if problem is not None:
            reader.fail_read(read, problem)
            return
        plan = self._copy_plan(read)
        if isinstance(plan, str):
            reader.fail_read(read, plan)
            return
        for copy in plan:
            copy()
        if self.on_transfer is not None:
            self.on_transfer(read)
        reader.counters.reads_completed += 1
        self.counters.reads_completed += 1
        reader.deliver(outcome(read.read_id, write=read.write, failed=None))
        if read.notify is not None:
            # Sent only now, after the copy: the holder cannot see it earlier.
            self.transmit(reader, read.holder, read.notify)

    def _check_read(self, read: PendingRead) -> str | None:
        holder = self._all.get(read.holder)
        if holder is None or not holder.alive:
            return f"peer {read.holder} is dead"
        a, b = read.reader.base_name, holder.base_name
        if (a, b) in self._cut or (b, a) in self._cut:
            return f"partitioned from {read.holder}"
        return None

    def _copy_plan(self, read: PendingRead) -> list[Callable[[], None]] | str:
        """Validate every byte range first, so a failed read copies nothing."""
        if not read.local_blocks:
            return []
        peer = self._all[read.holder].memory()
        mine = read.reader.memory()
        if peer is None:
            return f"peer {read.holder} registered no memory"
        if mine is None:
            return "local memory was unregistered"
        peer_mem, peer_layout = peer
        my_mem, my_layout = mine
        if peer_layout.num_regions != my_layout.num_regions:
            return f"{my_layout.num_regions} local regions vs {peer_layout.num_regions} remote"
        bad = [b for b in read.remote_blocks if not 0 <= b < peer_layout.num_blocks]
        if bad:
            return f"remote blocks {bad} outside 0..{peer_layout.num_blocks - 1}"
        plan: list[Callable[[], None]] = []
        for r in range(peer_layout.num_regions):
            try:
                roff, rlen = read.remote_slice.span(peer_layout.block_lens[r])
                loff, llen = read.local_slice.span(my_layout.block_lens[r])
            except Exception as exc:
                return str(exc)
            if rlen != llen:
                return f"region {r}: remote slice of {rlen} B into local slice of {llen} B"
            remote = (peer_mem, peer_layout.region_addrs[r], roff)
            local = (my_mem, my_layout.region_addrs[r], loff)
            src, dst = (local, remote) if read.write else (remote, local)
            for lb, rb in zip(read.local_blocks, read.remote_blocks, strict=True):
                src_block, dst_block = (lb, rb) if read.write else (rb, lb)
                plan.append(
                    _copier(
                        src=src[0],
                        src_addr=src[1],
                        src_block=src_block,
                        src_off=src[2],
                        dst=dst[0],
                        dst_addr=dst[1],
                        dst_block=dst_block,
                        dst_off=dst[2],
                        length=rlen,
                    )
                )
        return plan

    # --- stats ---------------------------------------------------------------------------

    @property
    def stats(self) -> LoopbackStats:
        """A snapshot of the totals over every endpoint."""
        return self.counters.snapshot()


def _copier(
    *,
    src: Memory,
    src_addr: int,
    src_block: int,
    src_off: int,
    dst: Memory,
    dst_addr: int,
    dst_block: int,
    dst_off: int,
    length: int,
) -> Callable[[], None]:
    def copy() -> None:
        dst.write(dst_addr, dst_block, dst_off, src.read(src_addr, src_block, src_off, length))

    return copy
