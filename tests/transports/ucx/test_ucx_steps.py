"""The UCX engine's step content on one thread: two endpoints stepped in turn, no engine thread.

What a step does (commands, sends, connections, arrivals, reads) is
:class:`~kvproto_transports.ucx.steps.Steps`; which thread runs it is the
engine's. Here one thread runs every step of both endpoints, so each outcome
follows from the steps alone (real UCX over TCP).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import pytest

from kvproto.transport import ReadCompleted, Received, TransportEvent
from kvproto_transports.conformance.hostmem import HostMemory
from kvproto_transports.ucx import ucx_available, unavailable_reason
from kvproto_transports.ucx.plan import plan_read
from kvproto_transports.ucx.shared import AddPeer, Read, ReadOp, Register, Shared, Stop
from kvproto_transports.ucx.steps import DEFAULT_UCX_OPTIONS, EngineConfig, Steps

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not ucx_available(), reason=f"UCX: {unavailable_reason()}"),
]


class Side:
    """One endpoint's step content, its shared state and its worker address."""

    def __init__(self, name: str, key: int) -> None:
        self.name = name
        self.shared = Shared(max_pending_sends=16)
        config = EngineConfig(
            local_peer=name,
            sender_key=key,
            ucx_options=DEFAULT_UCX_OPTIONS,
            connect_timeout_s=5.0,
            probe_interval_s=None,
            idle_wait_ms=50,
        )
        self.steps = Steps(config, self.shared)
        self.address = self.steps.setup()
        self.got: list[TransportEvent] = []

    def take(self) -> None:
        while self.shared.events:
            self.got.append(self.shared.events.popleft())


@pytest.fixture
def sides() -> Iterator[tuple[Side, Side]]:
    a, b = Side("a", 1), Side("b", 2)
    yield a, b
    for side in (a, b):
        side.steps.commands.append(Stop())
        side.steps.step()
        side.steps.teardown()


def _step_until(sides: tuple[Side, Side], done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the steps did not get there"
        for side in sides:
            side.steps.step()
            side.take()


def _connect(a: Side, b: Side, *, rkeys: tuple[bytes, ...] = ()) -> None:
    a.steps.commands.append(AddPeer(peer=b.name, address=b.address, rkeys=rkeys))
    b.steps.commands.append(AddPeer(peer=a.name, address=a.address, rkeys=()))


def test_a_notification_arrives_from_the_steps_alone(sides: tuple[Side, Side]) -> None:
    a, b = sides
    _connect(a, b)
    a.steps.run_commands()  # the connection exists (not wired up yet)
    assert a.shared.take_send_slot()
    a.steps.send(b.name, b"over the wire")  # queued until the connection is up
    _step_until(sides, lambda: bool(b.got))
    assert b.got == [Received(peer="a", payload=b"over the wire")]
    assert a.shared.stats.notifications_sent == 1
    assert b.shared.stats.notifications_received == 1
    assert b.shared.stats.hellos_received == 1


def test_a_read_lands_before_its_notify_with_the_steps_alone(sides: tuple[Side, Side]) -> None:
    reader, holder = sides
    memory = HostMemory()
    mine = memory.allocate(num_regions=2, block_len=256, num_blocks=4)
    theirs = memory.allocate(num_regions=2, block_len=256, num_blocks=4)
    for region in range(2):
        memory.write_block(theirs, region, 3, bytes([region + 7]) * 256)
    keys: Future[tuple[bytes, ...]] = Future()
    holder.steps.commands.append(Register(layout=theirs, result=keys))
    holder.steps.step()
    _connect(reader, holder, rkeys=keys.result(timeout=0))
    segments = plan_read(mine, theirs, local_blocks=[0], remote_blocks=[3])
    op = ReadOp(read_id=1, peer=holder.name, segments=segments, notify=b"done")
    reader.steps.commands.append(Read(op=op))
    _step_until(sides, lambda: bool(reader.got) and bool(holder.got))
    assert reader.got == [ReadCompleted(read_id=1)]
    assert holder.got == [Received(peer=reader.name, payload=b"done")]
    for region in range(2):
        assert memory.read_block(mine, region, 0) == bytes([region + 7]) * 256
    assert reader.shared.stats.reads_completed == 1
