"""An asyncio driver for :class:`~kvproto_binding.step.Binding`.

aioquic's ``asyncio/protocol.py`` for kvproto: the cores stay sans-I/O and
synchronous; this module is the only place where asyncio meets them. It

* owns the clock: ``now`` is ``loop.time()`` (``time.monotonic()`` on the
  default loops, the clock the cores expect), never allowed to run backwards;
* keeps **one** timer handle, re-armed after every step at
  :meth:`Binding.next_deadline` (the cores' ``get_timer()``); when it fires it
  steps with ``now = max(loop.time(), deadline)``, so the cores see their own
  deadline even if the loop ran the handle a clock tick early;
* steps as soon as the transport has events: a transport with
  ``set_wakeup(callback)`` (:class:`Wakeable`, e.g. ``UcxTransport``, whose
  engine thread calls it) wakes the loop through ``call_soon_threadsafe``,
  coalesced behind a flag; any other transport is polled every
  ``poll_interval_s`` (the Transport protocol gives no readiness signal, and
  ``poll`` is cheap and never blocks);
* forwards the application's calls (grant, adopt, track, start_read, ...) to
  the cores with ``now`` and schedules a step to carry out their outputs;
* hands the outputs to the application: every one as :class:`Happened` (an
  ``on_event`` callback, else a queue read by :meth:`AsyncBinding.events`),
  plus :meth:`~AsyncBinding.wait_freed` / :meth:`~AsyncBinding.wait_request`
  for one lease or request; ``Connect`` is answered by an async ``connector``
  (the side channel) if one is given.

All transport calls happen on the loop's thread, so transports with
``ThreadAffinity.OWNER`` work if the driver is created on their thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, runtime_checkable

from kvproto.errors import LocalProtocolError
from kvproto.events import (
    Connect,
    FreeBlocks,
    ReadConfirmed,
    ReadDeclined,
    ReadDeferred,
    ReadGo,
    RequestFailed,
)
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto.ticket import LeaseTicket
from kvproto.transport import PeerId

from .step import Binding

log = logging.getLogger("kvproto.aio")

DEFAULT_POLL_INTERVAL_S = 0.005
"""Poll period for transports without a wakeup hook. Lease deadlines are whole
seconds (heartbeat interval >= 1 s), so 5 ms only delays reads' completions."""

DriverEvent = FreeBlocks | RequestFailed | ReadConfirmed | Connect
"""What the cores ask the application to act on (``Connect`` only without a connector)."""

Connector = Callable[[Connect], Awaitable[bytes]]
"""Returns the transport metadata of holder ``(engine, rank)``; raising fails its requests."""


@runtime_checkable
class Wakeable(Protocol):
    """A transport that can say when ``poll`` has something (an optional extension)."""

    def set_wakeup(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` (from any thread, maybe spuriously) once events wait for ``poll``."""
        ...


class DriverClosed(Exception):
    """The driver was closed (or failed); nothing more will happen through it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Happened:
    """One output of the cores, stamped with the driver's clock."""

    at: float
    """``now`` of the step that produced it (loop time)."""
    event: DriverEvent
    """The output itself."""


@dataclass(slots=True)
class DriverStats:
    """What woke the driver, for tests and tuning."""

    steps: int = 0
    """Calls of :meth:`Binding.step`."""
    timer_steps: int = 0
    """Steps run by the re-armed core timer."""
    wakeups: int = 0
    """Steps run because the transport's wakeup hook fired."""
    polls: int = 0
    """Steps run by the fallback poll (transports without a wakeup hook)."""
    events_dropped: int = 0
    """Oldest queued events dropped because nobody read :meth:`AsyncBinding.events`."""
    connect_failures: int = 0
    """Connector calls that raised (their holder's requests failed)."""


K = TypeVar("K")
V = TypeVar("V")


class _Outcomes(Generic[K, V]):
    """One future per expected outcome; resolved ones are kept (bounded) for late waiters."""

    def __init__(self, loop: asyncio.AbstractEventLoop, keep: int) -> None:
        self._loop = loop
        self._keep = keep
        self._open: dict[K, asyncio.Future[V]] = {}
        self._done: OrderedDict[K, asyncio.Future[V]] = OrderedDict()

    def expect(self, key: K) -> None:
        self._done.pop(key, None)
        if key not in self._open:
            self._open[key] = self._loop.create_future()

    def resolve(self, key: K, value: V) -> None:
        fut = self._open.pop(key, None)
        if fut is None:
            return
        fut.set_result(value)
        self._done[key] = fut
        while len(self._done) > self._keep:
            self._done.popitem(last=False)

    async def wait(self, key: K, what: str) -> V:
        fut = self._open.get(key)
        if fut is None:
            fut = self._done.get(key)
        if fut is None:
            raise LocalProtocolError(f"{what} is not awaited through this driver")
        # shield: a cancelled waiter must not cancel the outcome for others.
        value = await asyncio.shield(fut)
        self._done.pop(key, None)
        return value

    def forget(self, key: K, what: str) -> None:
        fut = self._open.pop(key, None)
        self._done.pop(key, None)
        if fut is not None:  # not cancel(): a waiter would take it for its own cancellation
            self._fail(fut, LocalProtocolError(f"{what} was finished before its outcome"))

    def close(self, exc: BaseException) -> None:
        for fut in self._open.values():
            self._fail(fut, exc)
        self._open.clear()

    @staticmethod
    def _fail(fut: asyncio.Future[V], exc: BaseException) -> None:
        fut.set_exception(exc)
        fut.exception()  # retrieved: no "never retrieved" log for outcomes nobody awaited


class AsyncBinding:
    """Drives one :class:`Binding` (holder and/or reader + transport) from the running loop."""

    def __init__(
        self,
        binding: Binding,
        *,
        connector: Connector | None = None,
        on_event: Callable[[Happened], None] | None = None,
        poll_interval_s: float | None = DEFAULT_POLL_INTERVAL_S,
        max_queued_events: int = 65536,
        keep_outcomes: int = 4096,
    ) -> None:
        """Start driving ``binding``; must be called inside the running event loop.

        ``on_event`` gets every output in the loop (like aioquic's
        ``quic_event_received``); without it outputs are queued (the oldest
        dropped past ``max_queued_events``) for :meth:`events`.
        ``poll_interval_s`` applies only to transports without a wakeup hook
        (None: never poll; the application calls :meth:`wake`).
        ``keep_outcomes`` bounds the ended leases and requests remembered for
        :meth:`wait_freed` / :meth:`wait_request` calls that come late.
        """
        if poll_interval_s is not None and poll_interval_s <= 0:
            raise ValueError("poll_interval_s must be positive or None")
        self._loop = asyncio.get_running_loop()
        self.binding = binding
        self.stats = DriverStats()
        self.error: BaseException | None = None
        """Why the driver stopped, if a step raised."""
        self._connector = connector
        self._on_event = on_event
        self._queue: asyncio.Queue[Happened | None] = asyncio.Queue(max_queued_events)
        self._freed: _Outcomes[int, FreeBlocks] = _Outcomes(self._loop, keep_outcomes)
        self._requests: _Outcomes[str, ReadConfirmed | RequestFailed] = _Outcomes(
            self._loop, keep_outcomes
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._last = self._loop.time()
        self._closed = False
        self._timer: asyncio.TimerHandle | None = None
        self._step_soon: asyncio.Handle | None = None
        self._poll: asyncio.TimerHandle | None = None
        self._wake_pending = False
        self._poll_interval: float | None = None
        transport = binding.transport
        if isinstance(transport, Wakeable):
            transport.set_wakeup(self._wake_threadsafe)
        elif poll_interval_s is not None:
            self._poll_interval = poll_interval_s
            self._poll = self._loop.call_later(poll_interval_s, self._on_poll)
        self.wake()

    # ---------------------------------------------------------------- clock

    def now(self) -> float:
        """The driver's clock: loop time, never decreasing."""
        return self._advance(self._loop.time())

    def _advance(self, t: float) -> float:
        self._last = max(self._last, t)
        return self._last

    # ------------------------------------------------------------ holder API

    @property
    def holder(self) -> Holder:
        """The holder core (raises if this binding hosts none)."""
        if self.binding.holder is None:
            raise LocalProtocolError("this binding hosts no holder")
        return self.binding.holder

    def grant(self, request_id: str, *, ttl: float | None = None) -> LeaseTicket:
        """``Holder.grant`` now; :meth:`wait_freed` can then await the lease."""
        self._check()
        ticket = self.holder.grant(self.now(), request_id=request_id, ttl=ttl)
        self._freed.expect(ticket.lease)
        self.wake()
        return ticket

    def adopt(self, ticket: LeaseTicket) -> None:
        """``Holder.adopt`` now (a ticket minted by the scheduler for this engine)."""
        self._check()
        self.holder.adopt(self.now(), ticket)
        self._freed.expect(ticket.lease)
        self.wake()

    def revoke(self, lease_id: int) -> None:
        """``Holder.revoke`` now."""
        self._check()
        self.holder.revoke(self.now(), lease_id)
        self.wake()

    async def wait_freed(self, lease_id: int) -> FreeBlocks:
        """Wait until the lease's blocks are freed (any reason); once per lease."""
        self._check()
        return await self._freed.wait(lease_id, f"lease {lease_id}")

    # ------------------------------------------------------------ reader API

    @property
    def reader(self) -> Reader:
        """The reader core (raises if this binding hosts none)."""
        if self.binding.reader is None:
            raise LocalProtocolError("this binding hosts no reader")
        return self.binding.reader

    def track(self, request_id: str, ticket: LeaseTicket) -> None:
        """``Reader.track`` now: heartbeats start, a ``Connect`` goes to the connector."""
        self._check()
        self.reader.track(self.now(), request_id=request_id, ticket=ticket)
        self._requests.expect(request_id)
        self.wake()

    def connected(self, engine: str, rank: int, metadata: bytes) -> PeerId:
        """Answer a ``Connect`` with the holder's transport metadata (without a connector)."""
        self._check()
        peer = self.binding.connected(self.now(), engine=engine, rank=rank, metadata=metadata)
        self.wake()
        return peer

    def connect_failed(self, engine: str, rank: int) -> None:
        """Answer a ``Connect``: unreachable, its requests fail."""
        self._check()
        self.binding.connect_failed(self.now(), engine=engine, rank=rank)
        self.wake()

    def start_read(
        self, request_id: str, *, local_blocks: Sequence[int], remote_blocks: Sequence[int]
    ) -> ReadGo | ReadDeferred | ReadDeclined:
        """``Binding.start_read`` now; the outcome comes from :meth:`wait_request`."""
        self._check()
        decision = self.binding.start_read(
            self.now(), request_id, local_blocks=local_blocks, remote_blocks=remote_blocks
        )
        self.wake()
        return decision

    def finish(self, request_id: str) -> None:
        """``Reader.finish`` now (the request left the scheduler); its outcome is forgotten."""
        self._check()
        self.reader.finish(self.now(), request_id)
        self._requests.forget(request_id, f"request {request_id!r}")
        self.wake()

    async def wait_request(self, request_id: str) -> ReadConfirmed | RequestFailed:
        """Wait until a tracked request is confirmed (blocks safe to use) or failed."""
        self._check()
        return await self._requests.wait(request_id, f"request {request_id!r}")

    # ---------------------------------------------------------------- events

    async def next_event(self) -> Happened:
        """The next output; raises DriverClosed at the end.

        Only without ``on_event`` (with it, nothing is queued and this waits for the close).
        """
        item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)  # for the next caller
            raise DriverClosed("driver closed") from self.error
        return item

    async def events(self) -> AsyncIterator[Happened]:
        """Every output in order, as :meth:`next_event`; ends at close."""
        while True:
            try:
                yield await self.next_event()
            except DriverClosed:
                return

    def _emit(self, at: float, event: DriverEvent) -> None:
        happened = Happened(at=at, event=event)
        if self._on_event is not None:
            try:
                self._on_event(happened)
            except Exception:
                log.exception("on_event raised; the event is lost to the application")
            return
        self._enqueue(happened)

    def _enqueue(self, item: Happened | None) -> None:
        if self._queue.full():
            self._queue.get_nowait()
            self.stats.events_dropped += 1
        self._queue.put_nowait(item)

    # -------------------------------------------------------------- stepping

    def wake(self) -> None:
        """Step soon (loop thread): poll the transport, run due timers, carry out outputs."""
        if self._step_soon is None and not self._closed:
            self._step_soon = self._loop.call_soon(self._on_wake)

    def _wake_threadsafe(self) -> None:
        # Any thread (UCX: the engine thread). The flag is cleared on the loop before
        # it polls, so an event appended before this check is always polled.
        if self._wake_pending or self._closed:
            return
        self._wake_pending = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: so is the driver
            self._loop.call_soon_threadsafe(self._on_thread_wake)

    def _on_thread_wake(self) -> None:
        self._wake_pending = False
        self.stats.wakeups += 1
        self._step(self.now())

    def _on_wake(self) -> None:
        self._step_soon = None
        self._step(self.now())

    def _on_poll(self) -> None:
        assert self._poll_interval is not None
        self._poll = self._loop.call_later(self._poll_interval, self._on_poll)
        self.stats.polls += 1
        self._step(self.now())

    def _on_timer(self, due: float) -> None:
        self._timer = None
        self.stats.timer_steps += 1
        # asyncio runs a handle up to one clock resolution early: step at the deadline itself.
        self._step(self._advance(max(self._loop.time(), due)))

    def _step(self, now: float) -> None:
        if self._closed:
            return
        try:
            result = self.binding.step(now)
        except Exception as exc:
            log.exception("kvproto step failed; the driver stops")
            self.error = exc
            self._shutdown(DriverClosed(f"step failed: {type(exc).__name__}: {exc}"))
            return
        self.stats.steps += 1
        for freed in result.freed:
            self._freed.resolve(freed.lease, freed)
            self._emit(now, freed)
        for failed in result.failed:
            self._requests.resolve(failed.request_id, failed)
            self._emit(now, failed)
        for request_id in result.confirmed:
            confirmed = ReadConfirmed(request_id=request_id)
            self._requests.resolve(request_id, confirmed)
            self._emit(now, confirmed)
        for connect in result.connects:
            if self._connector is None:
                self._emit(now, connect)
            else:
                task = self._loop.create_task(self._connect(self._connector, connect))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        self._arm_timer()

    def _arm_timer(self) -> None:
        due = self.binding.next_deadline()
        timer = self._timer
        if timer is not None:
            if due is not None and timer.when() == due:
                return
            timer.cancel()
            self._timer = None
        if due is not None and not self._closed:
            self._timer = self._loop.call_at(due, self._on_timer, due)

    async def _connect(self, connector: Connector, connect: Connect) -> None:
        try:
            metadata = await connector(connect)
            if not self._closed:
                self.connected(connect.engine, connect.rank, metadata)
        except Exception as exc:  # the side channel's errors, TransportError from add_peer
            log.warning("connect to %s rank %d failed: %s", connect.engine, connect.rank, exc)
            self.stats.connect_failures += 1
            if not self._closed:
                self.connect_failed(connect.engine, connect.rank)

    # ------------------------------------------------------------- lifecycle

    def close(self, *, close_transport: bool = True) -> None:
        """Stop driving: cancel the timer, end waiters and :meth:`events`; idempotent.

        ``close_transport`` also closes the transport (which may wait for its
        own threads: :meth:`aclose` does that off the loop).
        """
        if not self._closed:
            self._shutdown(DriverClosed("driver closed"))
        if close_transport:
            self.binding.transport.close()

    async def aclose(self, *, close_transport: bool = True) -> None:
        """:meth:`close`, with the transport closed in a worker thread."""
        self.close(close_transport=False)
        if close_transport:
            await asyncio.to_thread(self.binding.transport.close)

    async def __aenter__(self) -> AsyncBinding:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _shutdown(self, exc: DriverClosed) -> None:
        self._closed = True
        for handle in (self._timer, self._step_soon, self._poll):
            if handle is not None:
                handle.cancel()
        self._timer = self._step_soon = self._poll = None
        for task in self._tasks:
            task.cancel()
        transport = self.binding.transport
        if isinstance(transport, Wakeable):
            transport.set_wakeup(None)
        self._freed.close(exc)
        self._requests.close(exc)
        self._enqueue(None)

    def _check(self) -> None:
        # After close nothing carries out the cores' outputs: refuse new work loudly.
        if self._closed:
            raise DriverClosed("driver closed") from self.error
