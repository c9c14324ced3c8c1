"""The asyncio driver (kvproto_binding.aio) over loopback (exact times) and real UCX.

Loopback cases run on an event loop with a virtual clock: when nothing is
ready, time jumps to the next handle, so a 100 s lease scenario takes
milliseconds and every time the cores see is exact. The loopback network is
advanced on that clock by a small pump, which wakes the drivers through the
same ``set_wakeup`` hook UCX offers. Assertions compare the driver's step
times with the cores' own deadlines, never with wall-clock speed.

UCX cases run on the ordinary loop: two real endpoints in this process
(grant, renew, exact bytes, done), and a reader driven by the same driver in a
child process that is killed (PeerLost frees the lease within 1 s).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import pytest

from kvproto.config import LeaseConfig
from kvproto.errors import LocalProtocolError
from kvproto.events import (
    Connect,
    FailReason,
    FreeBlocks,
    ReadConfirmed,
    ReadGo,
    ReleaseReason,
    RequestFailed,
)
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto.states import LeaseState
from kvproto.ticket import LeaseTicket
from kvproto.tpmath import BlockSlice
from kvproto.transport import PeerId, ReadId, TransportEvent
from kvproto_binding.aio import AsyncBinding, DriverClosed, Happened, Wakeable
from kvproto_binding.step import Binding
from kvproto_transports.forwarding import ForwardingTransport
from kvproto_transports.loopback import LinkFaults, LoopbackNetwork, LoopbackTransport
from kvproto_transports.ucx import ucx_available, unavailable_reason

# --- the loopback network, advanced on the loop's clock ----------------------------


class Pump:
    """Advances a LoopbackNetwork at its next event time, on the loop, and wakes drivers."""

    def __init__(self, net: LoopbackNetwork) -> None:
        self.net = net
        self.loop = asyncio.get_running_loop()
        self.hooked: list[WakeablePumped] = []
        self._handle: asyncio.TimerHandle | None = None

    def sync(self) -> None:
        """Bring the network to the loop's time (before anything is put on the wire)."""
        self._advance(self.loop.time())

    def kick(self) -> None:
        """Something was put on the wire: re-arm at the network's next event."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        due = self.net.next_event_time()
        if due is not None:
            self._handle = self.loop.call_at(due, self._fire, due)

    def _fire(self, due: float) -> None:
        self._handle = None
        self._advance(max(self.loop.time(), due))  # a handle may run a clock tick early
        self.kick()

    def _advance(self, now: float) -> None:
        self.net.advance(max(now, self.net.now))
        for transport in self.hooked:
            transport.collect()


class Pumped(ForwardingTransport[LoopbackTransport]):
    """A LoopbackTransport that keeps the pump in step; no wakeup hook (drivers poll it)."""

    def __init__(self, inner: LoopbackTransport, pump: Pump) -> None:
        super().__init__(inner)
        self.pump = pump

    def send(self, peer: PeerId, payload: bytes) -> None:
        self.pump.sync()
        super().send(peer, payload)
        self.pump.kick()

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
        self.pump.sync()
        read_id = super().read_blocks(
            peer,
            local_blocks=local_blocks,
            remote_blocks=remote_blocks,
            local_slice=local_slice,
            remote_slice=remote_slice,
            notify=notify,
        )
        self.pump.kick()
        return read_id


class WakeablePumped(Pumped):
    """The same with the wakeup hook: called when the network delivered something to it."""

    def __init__(self, inner: LoopbackTransport, pump: Pump) -> None:
        super().__init__(inner, pump)
        self._wakeup: Callable[[], None] | None = None
        self._held: list[TransportEvent] = []
        pump.hooked.append(self)

    def set_wakeup(self, callback: Callable[[], None] | None) -> None:
        self._wakeup = callback

    def collect(self) -> None:
        """Pump: take what was delivered; wake the driver if anything was."""
        if not self.inner.alive:
            return
        got = self.inner.poll()
        self._held.extend(got)
        if got and self._wakeup is not None:
            self._wakeup()

    def poll(self) -> Sequence[TransportEvent]:
        held, self._held = self._held, []
        return held + list(self.inner.poll())


DELAY = 0.001
BLOCK = 64


class World:
    """P (holder) and D (reader) drivers on one loopback network and one loop."""

    def __init__(self, *, wakeable: bool = True, poll_interval_s: float | None = None) -> None:
        self.cfg = LeaseConfig()  # 30 s lease: heartbeat every 5 s, extension 20 s
        self.net = LoopbackNetwork(seed=3, detection_delay=0.05)
        self.pump = Pump(self.net)
        self.p_ep = self.net.endpoint("P")
        self.d_ep = self.net.endpoint("D")
        self.net.set_link("P", "D", LinkFaults(delay=DELAY))
        self.net.set_link("D", "P", LinkFaults(delay=DELAY))
        self.p_layout = self.p_ep.allocate_layout(2, BLOCK, 8)
        self.p_ep.register_blocks(self.p_layout)
        self.d_ep.register_blocks(self.d_ep.allocate_layout(2, BLOCK, 8))
        self.p_ep.add_peer(self.d_ep.metadata())  # the side channel's introduction
        cls = WakeablePumped if wakeable else Pumped
        self.p = AsyncBinding(
            Binding(cls(self.p_ep, self.pump), holder=Holder(self.cfg, engine="P", incarnation=1)),
            poll_interval_s=poll_interval_s,
        )
        self.d = AsyncBinding(
            Binding(cls(self.d_ep, self.pump), reader=Reader(self.cfg, engine="D", incarnation=2)),
            connector=self._connector,
            poll_interval_s=poll_interval_s,
        )

    async def _connector(self, connect: Connect) -> bytes:
        assert (connect.engine, connect.rank) == ("P", 0)
        return self.p_ep.metadata()

    async def freed(self) -> tuple[float, FreeBlocks]:
        """The holder's next FreeBlocks, with the time of the step that produced it."""
        while True:
            happened = await self.p.next_event()
            if isinstance(happened.event, FreeBlocks):
                return happened.at, happened.event

    def close(self) -> None:
        self.p.close()
        self.d.close()


@pytest.mark.asyncio(loop_factories=["virtual"])
async def test_heartbeats_renew_for_100_s_then_read_exact_bytes_and_done_frees() -> None:
    loop = asyncio.get_running_loop()
    assert type(loop).__name__ == "VirtualClockLoop"
    w = World()
    for region in range(2):
        for block in range(8):
            w.p_ep.write_block(region, block, bytes([region * 16 + block]) * BLOCK)
    ticket = w.p.grant("p-1")
    w.d.track("d-1", ticket)
    await asyncio.sleep(100.0)  # queued for 100 s, more than three lease durations
    assert w.p.holder.lease_state(ticket.lease) is LeaseState.HELD
    hb = w.cfg.heartbeat_interval
    assert w.p.holder.stats.heartbeats >= 100 / hb - 2
    # Renewed: the holder's own deadline is the last heartbeat's arrival + extension.
    assert 100.0 < w.p.holder.deadline(ticket.lease) <= 100.0 + w.cfg.lease_extension
    t_read = loop.time()
    go = w.d.start_read("d-1", local_blocks=[0, 1, 2], remote_blocks=[5, 6, 7])
    assert isinstance(go, ReadGo)
    assert await w.d.wait_request("d-1") == ReadConfirmed(request_id="d-1")
    at, freed = await w.freed()
    assert freed == FreeBlocks(lease=ticket.lease, request_id="p-1", reason=ReleaseReason.DONE)
    # The read takes a round trip, the done one more link delay; the holder steps at once.
    assert at == pytest.approx(t_read + 3 * DELAY, abs=1e-9)
    assert await w.p.wait_freed(ticket.lease) == freed  # remembered for a late waiter
    for region in range(2):
        for local, remote in zip([0, 1, 2], [5, 6, 7], strict=True):
            assert w.d_ep.read_block(region, local) == bytes([region * 16 + remote]) * BLOCK
    # Nothing polled: every step was a timer, a wakeup or an application call.
    assert w.p.stats.polls == 0 and w.d.stats.polls == 0
    assert w.p.stats.wakeups > 0 and w.d.stats.timer_steps >= 100 / hb - 2
    w.close()


@pytest.mark.asyncio(loop_factories=["virtual"])
async def test_unclaimed_lease_frees_exactly_at_its_deadline_on_one_timer() -> None:
    w = World()
    ticket = w.p.grant("p-1")
    deadline = w.p.holder.deadline(ticket.lease)
    at, freed = await w.freed()
    assert freed.reason is ReleaseReason.EXPIRED
    assert at == deadline == ticket.deadline  # the core's own time, exactly
    # It slept on one timer: the first step (grant's outputs) and the deadline's.
    assert w.p.stats.steps == 2 and w.p.stats.timer_steps == 1
    w.close()


@pytest.mark.asyncio(loop_factories=["virtual"])
async def test_lease_lapses_at_the_holders_deadline_when_the_reader_driver_stops() -> None:
    w = World()
    ticket = w.p.grant("p-1")
    w.d.track("d-1", ticket)
    await asyncio.sleep(12.0)
    w.d.close(close_transport=False)  # the reader stops stepping; its transport stays up
    await asyncio.sleep(1.0)  # the last heartbeat has arrived
    deadline = w.p.holder.deadline(ticket.lease)
    assert 12.0 - w.cfg.heartbeat_interval + w.cfg.lease_extension < deadline
    assert deadline <= 12.0 + w.cfg.lease_extension
    steps, timer_steps = w.p.stats.steps, w.p.stats.timer_steps
    at, freed = await w.freed()
    assert freed.reason is ReleaseReason.EXPIRED
    assert at == deadline  # the timer fired at the core's deadline, not a tick after
    # Only the core's own timer (session, ticket, lease deadlines) woke the holder.
    assert w.p.stats.steps - steps == w.p.stats.timer_steps - timer_steps >= 1
    with pytest.raises(DriverClosed):
        await w.d.wait_request("d-1")
    w.close()


@pytest.mark.asyncio(loop_factories=["virtual"])
async def test_reader_crash_frees_when_the_transport_reports_it() -> None:
    w = World()
    ticket = w.p.grant("p-1")
    w.d.track("d-1", ticket)
    await asyncio.sleep(12.0)
    w.pump.sync()
    w.net.crash("D")
    w.pump.kick()
    at, freed = await w.freed()
    assert freed.reason is ReleaseReason.PEER_LOST
    assert at == pytest.approx(12.0 + 0.05, abs=1e-9)  # the loopback detection delay
    w.close()


@pytest.mark.asyncio(loop_factories=["virtual"])
async def test_transport_without_wakeup_is_polled_at_the_interval() -> None:
    w = World(wakeable=False, poll_interval_s=0.01)
    assert not isinstance(w.p.binding.transport, Wakeable)
    ticket = w.p.grant("p-1")
    w.d.track("d-1", ticket)
    await asyncio.sleep(12.0)
    w.pump.sync()
    w.net.crash("D")
    w.pump.kick()
    at, freed = await w.freed()
    assert freed.reason is ReleaseReason.PEER_LOST
    assert 12.05 <= at <= 12.05 + 0.01 + 1e-9  # seen at the first poll after it
    assert w.p.stats.polls >= 1200 and w.p.stats.wakeups == 0
    w.close()


@pytest.mark.asyncio(loop_factories=["virtual"])
async def test_connector_failure_fails_the_request_and_finish_ends_a_waiter() -> None:
    w = World()

    async def unreachable(connect: Connect) -> bytes:
        await asyncio.sleep(0.5)  # the side channel tries for a while
        raise ConnectionRefusedError("side channel: no answer")

    d = AsyncBinding(
        Binding(w.net.endpoint("D2"), reader=Reader(w.cfg, engine="D2", incarnation=3)),
        connector=unreachable,
    )
    d.track("d-1", w.p.grant("p-1"))
    failed = await d.wait_request("d-1")
    assert failed == RequestFailed(request_id="d-1", reason=FailReason.CONNECT_FAILED)
    assert d.stats.connect_failures == 1
    assert asyncio.get_running_loop().time() == pytest.approx(0.5, abs=1e-9)
    d.track("d-2", w.p.grant("p-2"))
    waiter = asyncio.ensure_future(d.wait_request("d-2"))
    await asyncio.sleep(0)
    d.finish("d-2")  # the request left the scheduler before any outcome
    with pytest.raises(LocalProtocolError, match="finished before its outcome"):
        await waiter
    d.close(close_transport=False)
    w.close()


@pytest.mark.asyncio(loop_factories=["virtual"])
async def test_close_cancels_the_timer_and_ends_waiters_and_events() -> None:
    w = World()
    ticket = w.p.grant("p-1")
    await asyncio.sleep(1.0)
    waiter = asyncio.ensure_future(w.p.wait_freed(ticket.lease))
    await asyncio.sleep(0)
    w.p.close()
    with pytest.raises(DriverClosed):
        await waiter
    assert [h async for h in w.p.events()] == []
    await asyncio.sleep(60.0)  # past the lease's deadline: no step runs any more
    assert w.p.holder.lease_state(ticket.lease) is LeaseState.GRANTED
    assert not w.p_ep.alive
    w.close()


# --- real UCX --------------------------------------------------------------------

UCX_CFG: dict[str, Any] = {"kv_lease_duration": 6, "read_margin": 1.0, "ack_timeout": 2.0}
REGIONS, UBLOCK, UBLOCKS = 2, 4096, 16


@pytest.fixture
def ucx_pair() -> Iterator[tuple[Any, Any, Any, Any]]:
    from kvproto_transports.conformance.hostmem import HostMemory
    from kvproto_transports.ucx import UcxTransport

    p_tr, d_tr = UcxTransport(name_prefix="holder"), UcxTransport(name_prefix="reader")
    p_mem, d_mem = HostMemory(), HostMemory()
    try:
        for tr, mem in ((p_tr, p_mem), (d_tr, d_mem)):
            tr.register_blocks(
                mem.allocate(num_regions=REGIONS, block_len=UBLOCK, num_blocks=UBLOCKS)
            )
        p_tr.add_peer(d_tr.metadata())
        yield p_tr, d_tr, p_mem, d_mem
    finally:
        p_tr.close()
        d_tr.close()


@pytest.mark.asyncio(loop_factories=["default"])
@pytest.mark.ucx
@pytest.mark.skipif(not ucx_available(), reason=f"UCX: {unavailable_reason()}")
async def test_ucx_lease_renewed_read_exact_bytes_done_frees(
    ucx_pair: tuple[Any, Any, Any, Any],
) -> None:
    p_tr, d_tr, p_mem, d_mem = ucx_pair
    loop = asyncio.get_running_loop()
    cfg = LeaseConfig(**UCX_CFG)  # heartbeat 1 s, extension 4 s
    for region in range(REGIONS):
        for block in range(UBLOCKS):
            p_mem.write_block(p_tr.layout, region, block, bytes([region * 32 + block]) * UBLOCK)

    async def connector(connect: Connect) -> bytes:
        return bytes(p_tr.metadata())

    p = AsyncBinding(Binding(p_tr, holder=Holder(cfg, engine="P", incarnation=1)))
    d = AsyncBinding(
        Binding(d_tr, reader=Reader(cfg, engine="D", incarnation=2)), connector=connector
    )
    ticket = p.grant("p-1")
    d.track("d-1", ticket)
    await asyncio.sleep(1.5)
    first = p.holder.deadline(ticket.lease)
    beats = p.holder.stats.heartbeats
    await asyncio.sleep(2.0)
    assert p.holder.lease_state(ticket.lease) is LeaseState.HELD
    assert p.holder.stats.heartbeats >= beats + 1
    renewed = p.holder.deadline(ticket.lease)
    assert renewed > first  # heartbeats moved the holder's deadline
    assert renewed - cfg.lease_extension <= loop.time()  # ...to a heartbeat's arrival + ext.
    t0 = loop.time()
    go = d.start_read("d-1", local_blocks=[0, 1, 2, 3], remote_blocks=[9, 10, 11, 12])
    assert isinstance(go, ReadGo)
    outcome = await asyncio.wait_for(d.wait_request("d-1"), 5.0)
    t_confirmed = loop.time()
    assert outcome == ReadConfirmed(request_id="d-1")
    freed = await asyncio.wait_for(p.wait_freed(ticket.lease), 5.0)
    assert freed.reason is ReleaseReason.DONE
    print(
        f"\nUCX via asyncio: read of 4 blocks x {REGIONS} regions confirmed after "
        f"{(t_confirmed - t0) * 1e3:.1f} ms; holder steps: {p.stats}"
    )
    for region in range(REGIONS):
        for local, remote in zip([0, 1, 2, 3], [9, 10, 11, 12], strict=True):
            assert (
                d_mem.read_block(d_tr.layout, region, local)
                == bytes([region * 32 + remote]) * UBLOCK
            )
    assert p.stats.polls == 0 and p.stats.wakeups > 0  # woken by the engine thread
    await p.aclose(close_transport=False)
    await d.aclose(close_transport=False)


def _reader_child(conn: Connection) -> None:
    """Child process: a reader core on UCX, driven by AsyncBinding in its own loop."""
    asyncio.run(_reader_main(conn))


async def _reader_main(conn: Connection) -> None:
    from kvproto_transports.ucx import UcxTransport

    transport = UcxTransport(name_prefix="reader")
    conn.send(transport.metadata())
    holder_meta, params, cfg = await asyncio.to_thread(conn.recv)

    async def connector(connect: Connect) -> bytes:
        return bytes(holder_meta)

    d = AsyncBinding(
        Binding(transport, reader=Reader(LeaseConfig(**cfg), engine="D", incarnation=2)),
        connector=connector,
    )
    d.track("d-1", LeaseTicket.from_params(params))
    conn.send("tracking")
    await asyncio.to_thread(conn.recv)  # killed before this returns
    await d.aclose()


def _recv(conn: Connection, timeout_s: float) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"child said nothing for {timeout_s} s")
    return conn.recv()


@pytest.mark.asyncio(loop_factories=["default"])
@pytest.mark.ucx
@pytest.mark.skipif(not ucx_available(), reason=f"UCX: {unavailable_reason()}")
async def test_ucx_killed_reader_process_frees_the_lease_within_1s() -> None:
    from kvproto_transports.ucx import UcxTransport

    loop = asyncio.get_running_loop()
    ctx = multiprocessing.get_context("spawn")  # never fork with UCX threads around
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_reader_child, args=(child,), name="aio-ucx-reader")
    proc.start()
    transport = UcxTransport(name_prefix="holder")
    events: list[Happened] = []
    p = AsyncBinding(
        Binding(transport, holder=Holder(LeaseConfig(**UCX_CFG), engine="P", incarnation=1)),
        on_event=events.append,
    )
    try:
        reader_meta = await asyncio.to_thread(_recv, parent, 60.0)
        p.binding.transport.add_peer(reader_meta)  # the side channel's introduction
        ticket = p.grant("p-1")
        parent.send((transport.metadata(), ticket.to_params(), UCX_CFG))
        assert await asyncio.to_thread(_recv, parent, 30.0) == "tracking"
        for _ in range(200):  # claimed by the reader's first heartbeat
            if p.holder.lease_state(ticket.lease) is LeaseState.HELD:
                break
            await asyncio.sleep(0.05)
        assert p.holder.lease_state(ticket.lease) is LeaseState.HELD
        assert proc.pid is not None
        killed_at = loop.time()
        os.kill(proc.pid, signal.SIGKILL)
        freed = await asyncio.wait_for(p.wait_freed(ticket.lease), 5.0)
        assert freed.reason is ReleaseReason.PEER_LOST
        at = next(h.at for h in events if isinstance(h.event, FreeBlocks))
        print(
            f"\nkill -9 of the reader process -> lease freed (PEER_LOST) by the asyncio "
            f"driver after {(at - killed_at) * 1e3:.1f} ms"
        )
        assert at - killed_at <= 1.0
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        await p.aclose()
        parent.close()
