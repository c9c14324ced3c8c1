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
    TransportError,
    TransportEvent,
    WritableTransport,
    WriteCompleted,
    WriteFailed,
    WriteId,
)
from kvproto_transports.conformance.factory import EndpointGroup, TransportFactory
from kvproto_transports.conformance.registry import Outcome, Unsupported

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

    def writer(self, i: int) -> WritableTransport:
        """The endpoint in slot ``i`` as a writer (Unsupported if the transport does not write)."""
        ep = self.ep(i)
        if not isinstance(ep, WritableTransport) or not ep.capabilities.writes:
            raise Unsupported("the transport does not write (capabilities.writes is False)")
        return ep

    def write_events(self, i: int, write_id: WriteId) -> list[WriteCompleted | WriteFailed]:
        """Terminal events of one write at slot ``i``."""
        return [
            e
            for e in self.events.get(i, [])
            if isinstance(e, WriteCompleted | WriteFailed) and e.write_id == write_id
        ]

    def read_events(self, i: int, read_id: ReadId) -> list[ReadCompleted | ReadFailed]:
        """Terminal events of one read at slot ``i``."""
        return [
            e
            for e in self.events.get(i, [])
            if isinstance(e, ReadCompleted | ReadFailed) and e.read_id == read_id
        ]


def notify_problems(net: Net, notifies: set[bytes], *, at: int, sender: int) -> list[str]:
    """What is wrong with how ``notifies`` reached slot ``at``: each must arrive (exactly once
    unless duplication is declared), attributed to slot ``sender``."""
    problems = []
    source = net.ep(sender).local_peer
    got = [r for r in net.received(at) if r.payload in notifies]
    for n in sorted(notifies):
        count = sum(1 for r in got if r.payload == n)
        if count == 0:
            problems.append(f"notify {n!r} never reached the holder")
        elif count > 1 and not net.caps.may_duplicate:
            problems.append(f"notify {n!r} delivered {count} times")
    if any(r.peer != source for r in got):
        problems.append("a notify was attributed to someone other than its sender")
    return problems


def must_fail(
    net: Net,
    what: str,
    start: Callable[[], int],
    ended: Callable[[int], Sequence[TransportEvent]],
    *,
    watch: int,
) -> str | None:
    """Issue a transfer that must not succeed (``start``); a problem description, or None if
    it failed well: a TransportError at once, or a failure event within the timeout with
    slot ``watch``'s memory (the side data would land in) unchanged."""
    layout = net.layouts[watch]
    cells = [(r, b) for r in range(layout.num_regions) for b in range(layout.num_blocks)]
    snapshot = [net.block(watch, r, b) for r, b in cells]
    try:
        tid = start()
    except TransportError:
        return None
    except Exception as exc:
        return f"{what}: raised {type(exc).__name__} (not a TransportError)"
    net.wait_until(lambda: bool(ended(tid)))
    kinds = [type(e) for e in ended(tid)]
    if not kinds:
        return f"{what}: no completion and no failure (hang)"
    if ReadCompleted in kinds or WriteCompleted in kinds:
        return f"{what}: {'WriteCompleted' if WriteCompleted in kinds else 'ReadCompleted'}"
    if [net.block(watch, r, b) for r, b in cells] != snapshot:
        return f"{what}: failed but the memory it would land in was modified"
    return None


def range_outcome(
    fail: Callable[[str, list[int], list[int]], str | None], blocks: int, kind: str
) -> Outcome:
    """Three transfers outside the layouts (``fail(what, local, remote)`` issues one and says
    what went wrong): past the peer's last block, far past it, past one's own."""
    problems = [
        p
        for p in (
            fail("remote block = num_blocks", [0], [blocks]),
            fail("remote block 10**6", [1], [10**6]),
            fail("local block = num_blocks", [blocks], [0]),
        )
        if p
    ]
    if problems:
        return Outcome(ok=False, detail="; ".join(problems))
    return Outcome(ok=True, detail=f"3 out-of-range {kind} refused or failed")


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
