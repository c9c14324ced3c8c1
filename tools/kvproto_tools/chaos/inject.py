"""Applying one planned fault to the running deployment, for real.

Kills are ``kill -9`` of the engine's whole process tree (the server, its
engine core and workers), then the same command on the same ports after the
planned downtime; the fault ends when the new incarnation answers /health.
Network faults are kernel rules and link states on the KV fabric (:mod:`.lan`),
removed when the fault ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kvproto_tools.chaos.history import Injected
from kvproto_tools.chaos.lan import Lan
from kvproto_tools.chaos.schedule import HOST_OF, Fault

RESTART_TIMEOUT_S = 600.0
"""How long a restarted engine may take to serve (the example's start-up wait is 240 s: on
a machine shared with other work, a restart took longer)."""


class Injector:
    """Applies faults to one deployment on one network."""

    def __init__(
        self,
        *,
        lan: Lan,
        deployment: Any,
        clock: Callable[[], float],
        incarnation: dict[str, int],
        scheduled: set[str],
        start_error: type[Exception],
        wait_healthy: Callable[[Any, str, float], float],
        stopping: threading.Event,
    ) -> None:
        """``start_error``: what the deployment raises for an engine that does not start;
        ``wait_healthy(proc, url, timeout_s)``: waits until it serves; ``stopping``: set when
        the run ends (a restart not begun by then is not begun)."""
        self._lan = lan
        self._deployment = deployment
        self._clock = clock
        self._incarnation = incarnation
        self._scheduled = scheduled
        self._start_error = start_error
        self._wait_healthy = wait_healthy
        self._stopping = stopping

    def apply(self, fault: Fault) -> Injected:
        """Apply ``fault`` and undo it when it is over (blocks meanwhile)."""
        if fault.kind in ("kill-decode", "kill-prefill"):
            return self._kill(fault)
        lan = self._lan
        hosts = [HOST_OF[name] for name in fault.target]
        a, b = hosts[0], hosts[-1]
        start = self._clock()
        try:
            if fault.kind == "partition":
                lan.partition(a, b)
                time.sleep(fault.length_s)
            elif fault.kind == "loss":
                lan.loss(a, b, fault.loss)
                time.sleep(fault.length_s)
            elif fault.kind == "flap":
                for k in range(fault.flaps):
                    lan.link_down(a)
                    time.sleep(fault.down_s)
                    lan.link_up(a)
                    if k + 1 < fault.flaps:
                        time.sleep(fault.up_s)
            else:
                raise ValueError(f"unknown fault kind {fault.kind!r}")
        finally:
            lan.heal()
        return Injected(fault=fault, start=start, end=self._clock())

    def _kill(self, fault: Fault) -> Injected:
        (name,) = fault.target
        dep = self._deployment
        proc = dep.procs[name]
        self._scheduled.add(name)
        start = self._clock()
        proc.kill()
        time.sleep(max(0.0, start + fault.length_s - self._clock()))
        if self._stopping.is_set():  # the run is ending: start nothing it would not stop
            return Injected(
                fault=fault, start=start, end=self._clock(), restarted=False, detail="run stopped"
            )
        try:
            self._start(name)
        except self._start_error as exc:
            return Injected(
                fault=fault, start=start, end=self._clock(), restarted=False, detail=str(exc)
            )
        self._scheduled.discard(name)
        return Injected(fault=fault, start=start, end=self._clock())

    def _start(self, name: str) -> None:
        """Start the next incarnation of engine ``name`` and wait (bounded) until it serves."""
        dep = self._deployment
        spec = next(s for s in [*dep.prefill_specs, dep.decode_spec] if s.name == name)
        self._incarnation[name] += 1
        proc = dep.start_engine(spec, wait=False)
        self._wait_healthy(proc, spec.url, RESTART_TIMEOUT_S)

    def restart_crashed(self) -> list[str]:
        """Start again every engine that died without being killed; their names."""
        dep = self._deployment
        crashed = []
        for spec in [*dep.prefill_specs, dep.decode_spec]:
            proc = dep.procs.get(spec.name)
            if proc is not None and not proc.alive() and spec.name not in self._scheduled:
                proc.wait_gone()
                self._start(spec.name)
                crashed.append(spec.name)
        return crashed
