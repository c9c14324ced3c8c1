"""The engine: who runs a step of the UCX endpoint, when, and on which thread.

What a step does is :class:`~kvproto_transports.ucx.steps.Steps`'s; here is
only the policy around it. A step always runs under :attr:`Engine._mutex`, so
that one thread at a time touches UCX and the endpoint's state.

Two kinds of thread get in. An API thread that finds the mutex free
(:meth:`Engine.drive`) carries out its command itself (a ``send`` leaves
for the socket at once), and ``poll`` runs a whole step, taking what
arrived without waking another thread. When only the engine thread touched
UCX, a round trip crossed four Python thread hand-offs (caller to engine,
engine to caller, each way), 45-60 us of bare hand-off alone, and the
transport's round trip was 3-3.5x the raw one; driven from the callers,
1.6-1.75x (measured side by side, ``kvproto bench --suite transport``).
The engine's own thread runs a step whenever the worker's event fd fires
(``ucp_worker_arm``, then ``poll`` on ucxx's epoll fd with the GIL
released) or ``idle_wait_ms`` pass: it serves the peer's RMA ``get`` over TCP, probes, timeouts and
failures while nobody polls. It waits outside the mutex and outside UCX,
so an API thread never waits for a sleeping engine.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

from kvproto.transport import PeerId

from .errors import UcxUnavailable
from .shared import Command, Send, Shared, Stop, UcxStats
from .steps import DEFAULT_UCX_OPTIONS, EngineConfig, Steps

__all__ = ["CALLER_WINDOW_S", "DEFAULT_UCX_OPTIONS", "Engine", "EngineConfig"]

log = logging.getLogger("kvproto.ucx")

CALLER_WINDOW_S = 1e-3
"""While no wakeup callback is set, a ``poll`` that ran a step this recently
comes from a polling caller that will run the next one: the engine thread
leaves the worker to it, unarmed, rather than wake on the event fd and take
the GIL for what the caller's step does anyway. Much shorter, the engine thread
re-checks often enough to collide with the caller again; longer, what only the
engine thread does (serve a peer's ``get`` once the caller stops polling, a
command queued while another API thread held the step) waits longer: at most
this long. An engine thread already waiting on the event fd when a caller comes
back (after a read, say) is signalled out by that caller's first step, or the
first arrival would wake it on that message's path. The measurements behind
the value: spec/benchmarks.md, "UCX: the caller window"."""


class Engine:
    """Runs the steps of one transport endpoint: on API threads when free, else its own."""

    def __init__(self, config: EngineConfig, shared: Shared) -> None:
        self._cfg = config
        self._shared = shared
        self._steps = Steps(config, shared)
        """Touched only under _mutex (its ``commands`` queue excepted)."""
        self._commands = self._steps.commands
        self._mutex = threading.Lock()
        """Held by the thread running a step: the engine's own, or an API thread in drive."""
        self._signal_lock = threading.Lock()
        self._worker_handle = 0  # 0: no worker to signal (not started, or torn down)
        self._sleeping = False
        self._armed_wait = False
        """The engine thread waits on the worker's event fd (armed): the next UCX
        event wakes it. A polling caller signals it out of there (CALLER_WINDOW_S)."""
        self._started: Future[bytes] = Future()
        self._thread = threading.Thread(
            target=self._main, name=f"kvproto-ucx-{config.local_peer}", daemon=True
        )
        self._caller_step_at = 0.0
        """Monotonic time of the last step an API thread ran (see CALLER_WINDOW_S)."""
        self.wakeup: Callable[[], None] | None = None
        """Called when a step leaves events for ``poll`` (an event loop's wakeup)."""

    # --- API side ---------------------------------------------------------

    def start(self, timeout_s: float) -> bytes:
        """Start the thread; returns the worker address once UCX is up."""
        self._thread.start()
        try:
            return self._started.result(timeout=timeout_s)
        except TimeoutError as exc:
            self.submit(Stop())
            raise UcxUnavailable(f"UCX did not start within {timeout_s} s") from exc

    def submit(self, command: Command) -> None:
        """Queue a command and carry it out now if no other thread is in the engine (any thread).

        Only the queued commands run here, not the rest of a step: a ``send``
        goes to the socket at once, and what it would find (arrivals, finished
        sends, a handshake's end) is for the next ``poll`` or the engine thread,
        so a loop of sends does not advance connections under itself.
        """
        self._commands.append(command)
        self.drive(whole_step=False)

    def send(self, peer: PeerId, payload: bytes) -> None:
        """A notification counted against the send budget: sent as :meth:`submit` would
        carry out a ``Send`` command (any thread), without making one unless it must wait."""
        self.drive(whole_step=False, send=(peer, payload))

    def drive(self, *, whole_step: bool, send: tuple[PeerId, bytes] | None = None) -> None:
        """Run the queued commands, then ``send`` (peer, payload) if given, or with
        ``whole_step`` a whole step, on this thread (any).

        Never waits: a busy mutex means another thread is in the engine, and
        the engine thread looks at the command queue again before it sleeps
        (``send`` joins the queue then).
        ``poll`` passes ``whole_step=True`` (it takes the events itself, so no
        wakeup); the commands alone call :attr:`wakeup` if events wait.
        """
        if not self._mutex.acquire(False):
            if send is not None:
                self._commands.append(Send(peer=send[0], payload=send[1]))
            # Another API thread may be past its command loop: wake a sleeping
            # engine so that nothing queued waits for idle_wait_ms.
            if self._sleeping:
                self._signal()
            return
        try:
            steps = self._steps
            if not steps.running:
                return
            try:
                if whole_step:
                    self._caller_step_at = steps.step()
                    if self._armed_wait and self.wakeup is None:
                        # Take over from an engine thread waiting on the event fd now,
                        # while this caller is between steps, rather than let the
                        # next arrival wake it on the path of that message.
                        self._armed_wait = False
                        self._signal()
                else:
                    if self._commands:
                        steps.run_commands()
                    if send is not None:
                        steps.send(*send)
                    self._notify()
            except Exception as exc:
                self._crash(exc)
            stopping = steps.stopping
        finally:
            self._mutex.release()
        if stopping:
            self._signal()  # the engine thread tears down, on its own thread

    def stats(self) -> UcxStats:
        """A copy of the counters, taken between two steps (waits for one in progress)."""
        with self._mutex:
            return replace(self._shared.stats)

    def stop(self, timeout_s: float) -> bool:
        """Ask the engine to tear down and wait; False if the thread did not end in time."""
        if not self._thread.is_alive():
            return True
        self.submit(Stop())
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _signal(self) -> None:
        with self._signal_lock:
            if self._worker_handle:
                self._steps.signal(self._worker_handle)

    # --- thread -----------------------------------------------------------

    def _main(self) -> None:
        try:
            with self._mutex:
                address = self._steps.setup()
                with self._signal_lock:
                    self._worker_handle = self._steps.worker_handle
        except Exception as exc:
            self._started.set_exception(
                exc if isinstance(exc, UcxUnavailable) else UcxUnavailable(f"UCX setup: {exc}")
            )
            with self._mutex:
                self._teardown()
            return
        self._started.set_result(address)
        try:
            self._loop()
        finally:
            with self._mutex:
                self._teardown()

    def _crash(self, exc: Exception) -> None:
        """A step raised: nothing moves any more; say so, and report every peer lost."""
        log.error("UCX engine of %s crashed", self._cfg.local_peer, exc_info=exc)
        self._steps.fail(f"UCX engine crashed: {type(exc).__name__}: {exc}")
        self._notify()

    def _teardown(self) -> None:
        with self._signal_lock:
            self._worker_handle = 0
        self._steps.teardown()

    def _loop(self) -> None:
        wait_ms = self._cfg.idle_wait_ms
        waiter = select.poll()
        steps = self._steps
        waiter.register(steps.event_fd, select.POLLIN)
        while True:
            with self._mutex:
                armed = False
                try:
                    steps.step()
                    if not steps.stopping:
                        self._notify()
                    # arm() is False while UCX has events unprogressed: step again.
                    armed = not steps.stopping and not self._commands and steps.arm()
                except Exception as exc:
                    self._crash(exc)
                if steps.stopping:
                    return
            self._sleeping = True
            # Set before this re-check, read by drive after its queue append: a
            # command queued meanwhile is seen here or signals the worker.
            if armed and not self._commands:
                self._armed_wait = True
                waiter.poll(wait_ms)  # outside the mutex and UCX, GIL released
                self._armed_wait = False
            self._leave_to_caller()
            self._sleeping = False

    def _leave_to_caller(self) -> None:
        """Sleep, unarmed, while a polling caller runs the steps (see CALLER_WINDOW_S).

        Not with a wakeup callback: its owner polls when told to, so the
        engine thread must see the events. A command queued meanwhile by a
        thread that found the mutex busy waits at most one window.
        """
        while self.wakeup is None and not self._commands and not self._steps.stopping:
            left = self._caller_step_at + CALLER_WINDOW_S - time.monotonic()
            if left <= 0:
                return
            time.sleep(left)

    def _notify(self) -> None:
        # Once per step while events are unpolled: a coalescing waker (asyncio's
        # call_soon_threadsafe behind a flag) costs one attribute check here, and
        # no event waits for the next idle_wait_ms.
        wakeup = self.wakeup
        if wakeup is not None and self._shared.events:
            try:
                wakeup()
            except Exception:
                log.exception("wakeup callback of %s failed", self._cfg.local_peer)
