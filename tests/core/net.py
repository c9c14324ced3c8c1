"""A small deterministic network of holders and readers for exact-time tests.

:class:`~tests.core.pair.Pair` wires one holder to one reader with zero
delay. This harness adds what the multi-node tests need, while keeping every
time exact:

* any number of holder and reader ranks (heterogeneous TP);
* one *true* clock and a per-node clock offset (a holder at +3600 s);
* per-link latency and seeded faults (drop, duplicate, jitter, reorder), the
  loopback network's own (:class:`~kvproto_transports.loopback.Links`);
* reads that take time: the done frame reaches the holder when the transfer
  ends, as a NIXL ``notif_msg`` does;
* paused nodes (a long forward pass: nothing is polled until it resumes) and
  crashed nodes (silent; peers may be told ``peer_lost``).

The event loop calls ``handle_timer`` exactly at each node's ``get_timer()``,
so "freed at last heartbeat + extension" can be asserted to the float.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvproto import wire
from kvproto.config import LeaseConfig
from kvproto.events import (
    Connect,
    FreeBlocks,
    ReadConfirmed,
    ReadDeclined,
    ReadDeferred,
    ReadGo,
    RequestFailed,
    SendFrame,
)
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto.ticket import LeaseTicket
from kvproto_transports.loopback import LinkFaults, Links

from .pair import counter_entropy


@dataclass
class Node:
    """One holder or reader rank and its clock."""

    name: str
    core: Holder | Reader
    offset: float = 0.0
    last_local: float = -math.inf
    paused_until: float = -math.inf
    crashed: bool = False
    inbox: list[tuple[str, bytes]] = field(default_factory=list)
    deferred: list[Callable[[], None]] = field(default_factory=list)


@dataclass(frozen=True)
class Delivered:
    """A frame that reached its destination."""

    sent: float
    arrived: float
    src: str
    dst: str
    payload: bytes


@dataclass
class TransferRecord:
    """One READ from one holder rank."""

    reader: str
    request_id: str
    holder: str
    lease: int
    begin: float
    end: float


class Net:
    """Holders and readers over seeded, exact-time links. See the module docstring."""

    def __init__(self, config: LeaseConfig | None = None, *, seed: int = 0) -> None:
        self.config = config or LeaseConfig()
        self.now = 0.0
        self.nodes: dict[str, Node] = {}
        self.links = Links(seed)
        """Every link's faults (``links.default`` for those not set), dice and order."""
        self.auto_connect = True
        self.connect_delay = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._entropy_seed = itertools.count(1)
        self.freed: list[tuple[float, str, FreeBlocks]] = []
        self.failed: list[tuple[float, str, RequestFailed]] = []
        self.confirmed: list[tuple[float, str, str]] = []
        self.connects: list[tuple[float, str, Connect]] = []
        self.delivered: list[Delivered] = []
        self.sent: list[tuple[float, str, str, bytes]] = []
        self.transfers: list[TransferRecord] = []
        self.tickets: dict[tuple[str, str], LeaseTicket] = {}
        self.frame_filter: Callable[[str, str, bytes], bool] | None = None
        """Return False to drop a frame (targeted loss in a test)."""

    # ------------------------------------------------------------ building

    def add_holder(
        self,
        name: str,
        *,
        engine: str = "P",
        incarnation: int = 7,
        rank: int = 0,
        tp_size: int = 1,
        offset: float = 0.0,
        config: LeaseConfig | None = None,
    ) -> Holder:
        holder = Holder(
            config or self.config,
            engine=engine,
            incarnation=incarnation,
            rank=rank,
            tp_size=tp_size,
            entropy=counter_entropy(1000 * next(self._entropy_seed)),
        )
        self.nodes[name] = Node(name, holder, offset)
        return holder

    def add_reader(
        self,
        name: str,
        *,
        engine: str = "D",
        incarnation: int = 9,
        rank: int = 0,
        tp_size: int = 1,
        offset: float = 0.0,
        config: LeaseConfig | None = None,
        replicated_kv: bool = False,
    ) -> Reader:
        reader = Reader(
            config or self.config,
            engine=engine,
            incarnation=incarnation,
            rank=rank,
            tp_size=tp_size,
            replicated_kv=replicated_kv,
            entropy=counter_entropy(1000 * next(self._entropy_seed)),
        )
        self.nodes[name] = Node(name, reader, offset)
        return reader

    def set_link(self, src: str, dst: str, faults: LinkFaults) -> None:
        """Set the faults of the directed link ``src -> dst``."""
        self.links.set((src, dst), faults)

    def holder(self, name: str) -> Holder:
        core = self.nodes[name].core
        assert isinstance(core, Holder)
        return core

    def reader(self, name: str) -> Reader:
        core = self.nodes[name].core
        assert isinstance(core, Reader)
        return core

    def local(self, name: str) -> float:
        """The node's clock now (never runs backwards)."""
        node = self.nodes[name]
        node.last_local = max(node.last_local, self.now + node.offset)
        return node.last_local

    # ------------------------------------------------------------ actions

    def grant(self, holder: str, request_id: str, *, ttl: float | None = None) -> LeaseTicket:
        ticket = self.holder(holder).grant(self.local(holder), request_id=request_id, ttl=ttl)
        self.collect()
        return ticket

    def adopt(self, holder: str, ticket: LeaseTicket) -> None:
        self.holder(holder).adopt(self.local(holder), ticket)

    def track(self, reader: str, request_id: str, ticket: LeaseTicket, *, readers: int = 1) -> None:
        self.tickets[(reader, request_id)] = ticket
        self.reader(reader).track(
            self.local(reader), request_id=request_id, ticket=ticket, readers=readers
        )
        self.collect()

    def finish(self, reader: str, request_id: str) -> None:
        self.reader(reader).finish(self.local(reader), request_id)
        self.collect()

    def start_read(
        self,
        reader: str,
        request_id: str,
        duration: float = 0.0,
        *,
        lose_done: bool = False,
    ) -> ReadGo | ReadDeferred | ReadDeclined:
        """Begin the read now; each transfer ends ``duration`` later (done arrives then)."""
        core = self.reader(reader)
        result = core.begin_read(self.local(reader), request_id)
        self.collect()
        if isinstance(result, (ReadDeclined, ReadDeferred)):
            return result
        ticket = self.tickets[(reader, request_id)]
        end = self.now + duration
        for order in result.orders:
            record = TransferRecord(reader, request_id, order.peer, ticket.lease, self.now, end)
            self.transfers.append(record)

            def finish_transfer(order=order) -> None:  # type: ignore[no-untyped-def]
                holder_node = self.nodes[order.peer]
                if order.notify and not lose_done and not holder_node.crashed:
                    self._arrive(reader, order.peer, order.notify, self.now)
                node = self.nodes[reader]
                if node.crashed:
                    return

                def complete() -> None:
                    core.read_completed(self.local(reader), request_id, order.holder_rank)

                if node.paused_until > self.now:
                    node.deferred.append(complete)  # polled at the next step boundary
                else:
                    complete()

            self.at(end, finish_transfer)
        return result

    def pause(self, name: str, until: float) -> None:
        """The node polls nothing until ``until`` (a long forward pass)."""
        node = self.nodes[name]
        node.paused_until = until
        self.at(until, lambda: self._resume(node))

    def crash(self, name: str, *, detect_after: float | None = None) -> None:
        """The node dies silently; with ``detect_after`` its peers get peer_lost then."""
        node = self.nodes[name]
        node.crashed = True
        if detect_after is None:
            return

        def notify() -> None:
            for other in self.nodes.values():
                if other.crashed or other is node:
                    continue
                other.core.peer_lost(self.local(other.name), name)
            self.collect()

        self.at(self.now + detect_after, notify)

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._seq), fn))

    # ------------------------------------------------------------ running

    def run_until(self, end: float) -> None:
        """Process every event and timer due up to true time ``end``, in time order."""
        spins = 0
        last = -math.inf
        while True:
            self.collect()
            t_event = self._events[0][0] if self._events else math.inf
            t_timer, timer_node = math.inf, None
            for node in self.nodes.values():
                if node.crashed or node.paused_until > self.now:
                    continue
                due = node.core.get_timer()
                if due is not None and due - node.offset < t_timer:
                    t_timer, timer_node = due - node.offset, node
            t = min(t_event, t_timer)
            if t > end:
                break
            spins = spins + 1 if t <= last else 0
            if spins > 10_000:
                raise AssertionError(f"timer loop stuck at {t} ({timer_node and timer_node.name})")
            last = t
            self.now = max(self.now, t)
            if timer_node is not None and t_timer <= t_event:
                due = timer_node.core.get_timer()
                assert due is not None
                timer_node.last_local = max(self.local(timer_node.name), due)
                timer_node.core.handle_timer(timer_node.last_local)
            else:
                _, _, fn = heapq.heappop(self._events)
                fn()
        self.now = max(self.now, end)
        self.collect()

    def collect(self) -> None:
        """Route every node's outputs."""
        progress = True
        while progress:
            progress = False
            for node in list(self.nodes.values()):
                if node.crashed:
                    node.core.drain()
                    continue
                for out in node.core.drain():
                    progress = True
                    self._route(node, out)

    def _route(self, node: Node, out: object) -> None:
        if isinstance(out, SendFrame):
            self._send(node.name, out.peer, out.payload)
        elif isinstance(out, FreeBlocks):
            self.freed.append((self.now, node.name, out))
        elif isinstance(out, RequestFailed):
            self.failed.append((self.now, node.name, out))
        elif isinstance(out, ReadConfirmed):
            self.confirmed.append((self.now, node.name, out.request_id))
        elif isinstance(out, Connect):
            self.connects.append((self.now, node.name, out))
            if self.auto_connect:
                self.at(self.now + self.connect_delay, lambda: self._connect(node.name, out))
        else:  # pragma: no cover - the core has no other outputs
            raise AssertionError(out)

    def _connect(self, reader: str, connect: Connect) -> None:
        core = self.reader(reader)
        for node in self.nodes.values():
            h = node.core
            if (
                isinstance(h, Holder)
                and not node.crashed
                and h.engine == connect.engine
                and h.rank == connect.rank
            ):
                core.connected(
                    self.local(reader), engine=connect.engine, rank=connect.rank, peer=node.name
                )
                self.collect()
                return
        core.connect_failed(self.local(reader), engine=connect.engine, rank=connect.rank)
        self.collect()

    def _send(self, src: str, dst: str, payload: bytes) -> None:
        self.sent.append((self.now, src, dst, payload))
        if self.frame_filter is not None and not self.frame_filter(src, dst, payload):
            return
        passage = self.links.passage(self.now, (src, dst), (src, dst))
        if passage is None:
            return
        when, _, copies = passage
        for _ in range(copies):
            self.at(when, lambda sent=self.now: self._arrive(src, dst, payload, sent))

    def _arrive(self, src: str, dst: str, payload: bytes, sent: float) -> None:
        node = self.nodes.get(dst)
        if node is None or node.crashed:
            return
        if node.paused_until > self.now:
            node.inbox.append((src, payload))
            return
        self.delivered.append(Delivered(sent, self.now, src, dst, payload))
        node.core.handle_frame(self.local(dst), src, payload)
        self.collect()

    def _resume(self, node: Node) -> None:
        if node.paused_until > self.now or node.crashed:
            return
        deferred, node.deferred = node.deferred, []
        for fn in deferred:
            fn()
        inbox, node.inbox = node.inbox, []
        for src, payload in inbox:
            self.delivered.append(Delivered(self.now, self.now, src, node.name, payload))
            node.core.handle_frame(self.local(node.name), src, payload)
        node.core.handle_timer(self.local(node.name))
        self.collect()

    # ------------------------------------------------------------ queries

    def arrivals(self, src: str, dst: str, kind: type) -> list[float]:
        """True arrival times of delivered frames of one message kind on a link."""
        out = []
        for d in self.delivered:
            if d.src == src and d.dst == dst:
                try:
                    msg = wire.decode(d.payload)
                except Exception:
                    continue
                if isinstance(msg, kind):
                    out.append(d.arrived)
        return out

    def freed_leases(self, holder: str | None = None) -> list[tuple[float, int, str]]:
        """(true time, lease, reason) of every FreeBlocks, optionally of one holder."""
        return [
            (t, f.lease, f.reason.name) for t, h, f in self.freed if holder is None or h == holder
        ]

    def failures(self, reader: str | None = None) -> list[tuple[float, str, str]]:
        return [
            (t, f.request_id, f.reason.name)
            for t, r, f in self.failed
            if reader is None or r == reader
        ]

    def check_no_silent_overlap(self) -> None:
        """Every confirmed read's blocks were still held when its transfer ended."""
        confirmed = {(r, rid) for _, r, rid in self.confirmed}
        for tr in self.transfers:
            if (tr.reader, tr.request_id) not in confirmed:
                continue
            for t, holder, f in self.freed:
                if holder == tr.holder and f.lease == tr.lease:
                    assert t >= tr.end, (
                        f"{tr.reader}/{tr.request_id} confirmed but {holder} freed lease "
                        f"{tr.lease} at {t} before its transfer ended at {tr.end}"
                    )
