"""Helpers the cases share: fresh groups, polling, waiting on the group's clock."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Sequence

from kvproto.tpmath import BlockLayout
from kvproto.transport import (
    Capabilities,
    PeerId,
    PeerLost,
    ReadCompleted,
    ReadFailed,
    ReadId,
    Received,
    Transport,
    TransportEvent,
)
from kvproto_transports.conformance.factory import EndpointGroup, TransportFactory
from kvproto_transports.conformance.registry import Unsupported

Hook = Callable[[int, TransportEvent], None]
"""Called with (slot, event) the moment the kit observes an event."""


class Net:
    """A group as the cases use it: slots, peer ids, every observed event, a clock."""

    def __init__(self, group: EndpointGroup, factory: TransportFactory) -> None:
        self.group = group
        self.factory = factory
        self.dead: set[int] = set()
        """Slots the kit killed (never polled again)."""
        self.ids: dict[tuple[int, int], PeerId] = {}
        """(i, j) -> the peer id ``add_peer`` returned at slot i for slot j."""
        self.events: dict[int, list[TransportEvent]] = {}
        """Every event observed at each slot, in order."""
        self.hooks: list[Hook] = []
        """Called for each event as it is observed (a case can react at that instant)."""
        self.max_poll_s = 0.0
        """Longest wall time any ``poll`` took in this group."""
        self.layouts: dict[int, BlockLayout] = {}
        """Registered layout of each slot (via :meth:`memory`)."""

    # --- endpoints -------------------------------------------------------------------

    def ep(self, i: int) -> Transport:
        """The endpoint in slot ``i``."""
        return self.group.endpoints[i]

    @property
    def size(self) -> int:
        """Number of slots."""
        return len(self.group.endpoints)

    @property
    def caps(self) -> Capabilities:
        """Capabilities of slot 0 (T0.1 checks that every slot declares the same)."""
        return self.ep(0).capabilities

    def connect(self, i: int, j: int) -> PeerId:
        """Slot ``i`` adds slot ``j``; returns the peer id."""
        pid = self.ep(i).add_peer(self.ep(j).metadata())
        self.ids[(i, j)] = pid
        return pid

    def link(self, i: int, j: int) -> None:
        """Slots ``i`` and ``j`` add each other."""
        self.connect(i, j)
        self.connect(j, i)

    def mesh(self, slots: Sequence[int] | None = None) -> None:
        """Every pair of ``slots`` (default: all) adds each other."""
        slots = list(range(self.size)) if slots is None else list(slots)
        for i in slots:
            for j in slots:
                if i != j:
                    self.connect(i, j)

    def kill(self, i: int) -> None:
        """Kill slot ``i`` (Unsupported if the group cannot)."""
        if not self.group.can_kill:
            raise Unsupported("the factory cannot kill an endpoint")
        self.group.kill(i)
        self.dead.add(i)

    # --- memory --------------------------------------------------------------------

    def memory(
        self, i: int, *, num_regions: int, block_len: int, num_blocks: int, register: bool = True
    ) -> BlockLayout:
        """Allocate (and by default register) memory for slot ``i``."""
        layout = self.group.allocate(
            i, num_regions=num_regions, block_len=block_len, num_blocks=num_blocks
        )
        if register:
            self.ep(i).register_blocks(layout)
        self.layouts[i] = layout
        return layout

    def fill(self, i: int, blocks: Sequence[int], tag: str) -> None:
        """Write :func:`pattern` data into ``blocks`` of every region of slot ``i``."""
        layout = self.layouts[i]
        for r in range(layout.num_regions):
            for b in blocks:
                self.group.write_block(
                    i, layout, r, b, pattern(f"{tag}/{r}/{b}", layout.block_lens[r])
                )

    def block(self, i: int, region: int, block: int) -> bytes:
        """Current bytes of one block of slot ``i``."""
        return self.group.read_block(i, self.layouts[i], region, block)

    # --- events ----------------------------------------------------------------------

    def poll(self, i: int) -> list[TransportEvent]:
        """Poll slot ``i`` once; record, hook and return what it reported."""
        t0 = time.perf_counter()
        got = list(self.ep(i).poll())
        self.max_poll_s = max(self.max_poll_s, time.perf_counter() - t0)
        self.events.setdefault(i, []).extend(got)
        for ev in got:
            for hook in self.hooks:
                hook(i, ev)
        return got

    def poll_all(self) -> None:
        """Poll every live slot once."""
        for i in range(self.size):
            if i not in self.dead:
                self.poll(i)

    def wait_until(self, done: Callable[[], bool], timeout: float | None = None) -> bool:
        """Poll and let group time pass until ``done()`` or ``timeout`` (group clock)."""
        deadline = self.group.now() + (self.factory.timeout_s if timeout is None else timeout)
        while True:
            self.poll_all()
            if done():
                return True
            remaining = deadline - self.group.now()
            if remaining <= 0:
                return False
            self.group.wait(remaining)

    def settle(self, duration: float | None = None) -> None:
        """Keep polling for ``duration`` (default ``settle_s``) to catch late or extra events."""
        self.wait_until(lambda: False, self.factory.settle_s if duration is None else duration)

    # --- views of what was observed ----------------------------------------------------

    def received(self, i: int) -> list[Received]:
        """Notifications observed at slot ``i``."""
        return [e for e in self.events.get(i, []) if isinstance(e, Received)]

    def payloads(self, i: int) -> list[bytes]:
        """Payloads observed at slot ``i``, in arrival order."""
        return [e.payload for e in self.received(i)]

    def lost(self, i: int) -> list[PeerId]:
        """Peers reported lost at slot ``i``."""
        return [e.peer for e in self.events.get(i, []) if isinstance(e, PeerLost)]

    def read_events(self, i: int, read_id: ReadId) -> list[ReadCompleted | ReadFailed]:
        """Terminal events of one read at slot ``i``."""
        return [
            e
            for e in self.events.get(i, [])
            if isinstance(e, ReadCompleted | ReadFailed) and e.read_id == read_id
        ]


class Ctx:
    """Per-case context: makes groups and closes them after the case."""

    def __init__(self, factory: TransportFactory) -> None:
        self.factory = factory
        self._nets: list[Net] = []

    def net(self, size: int) -> Net:
        """A fresh group of ``size`` endpoints."""
        n = Net(self.factory.create_group(size), self.factory)
        self._nets.append(n)
        return n

    def close(self) -> None:
        """Close every group; teardown errors are not the case's verdict."""
        for n in self._nets:
            with contextlib.suppress(Exception):  # close is checked by T1.4, not here
                n.group.close()
        self._nets.clear()


def pattern(tag: str, length: int) -> bytes:
    """``length`` deterministic bytes derived from ``tag`` (contains NULs and non-UTF-8)."""
    out = bytearray()
    counter = 0
    while len(out) < length:
        out += hashlib.blake2b(f"{tag}#{counter}".encode(), digest_size=64).digest()
        counter += 1
    return bytes(out[:length])


def short(data: bytes, limit: int = 24) -> str:
    """A bytes repr cut to ``limit`` bytes, with the length."""
    body = repr(data[:limit]) + ("..." if len(data) > limit else "")
    return f"{body} ({len(data)} B)"


def plural(n: int, word: str) -> str:
    """``"1 message"`` / ``"3 messages"``."""
    return f"{n} {word}{'' if n == 1 else 's'}"
