"""Time a KV connector's hooks from inside vLLM's own engine step (the ``vllm-step`` suite).

:func:`timed_connector_class` derives a class from a connector whose hook
methods add their ``perf_counter_ns`` time (wall) and their
``thread_time_ns`` time (the engine thread's CPU) to a per-role total; the
engine driver (:mod:`.step_engine`) reads and resets the totals around each
``LLMEngine.step()``, so one sample is what the connector cost that step,
scheduler side and worker side. Wall time is what the step waits for; CPU
time leaves out what the thread spent descheduled (another thread or process
on its core), so it does not grow with the other load on the core. Nothing of
vLLM is patched: the derived class is loaded by vLLM's connector factory
through ``kv_connector_module_path`` (:mod:`.step_connectors`), and every call
still runs the real hook.

A hook that calls another hook (stock ``get_finished`` calls
``get_transfer_results``) is counted once: only the outermost call on an
instance adds its time.
"""

from __future__ import annotations

import functools
import inspect
import time
import types
from collections.abc import Callable
from typing import Any

SIDES = ("scheduler", "worker")
"""The two halves vLLM builds a connector as (``KVConnectorRole``)."""


def hook_names(cls: type) -> list[str]:
    """Every public instance method ``cls`` has or inherits: vLLM's hooks, whatever its version.

    Class and static methods are left out (no instance, no role). Hooks that
    run outside a step (``register_kv_caches``, handshakes) are timed too but
    fall between samples, which the driver discards.
    """
    return sorted(
        name
        for name in dir(cls)
        if not name.startswith("_")
        and isinstance(inspect.getattr_static(cls, name), types.FunctionType)
    )


class StepTotals:
    """Nanoseconds spent in connector hooks since the last :meth:`take`, per side."""

    def __init__(self) -> None:
        self.ns = dict.fromkeys(SIDES, 0)
        """Side -> wall nanoseconds."""
        self.cpu_ns = 0
        """The calling thread's CPU nanoseconds in hooks, both sides (one thread runs
        both in an in-process engine)."""
        self.hooks: dict[tuple[str, str], tuple[int, int]] = {}
        """(side, hook) -> (calls, ns) since the last take: where a step's time goes."""

    def take(self) -> tuple[dict[str, int], int, dict[tuple[str, str], tuple[int, int]]]:
        """The per-side wall totals, the CPU total and the per-hook (calls, wall ns) so
        far; all reset to zero."""
        ns, cpu_ns, hooks = self.ns, self.cpu_ns, self.hooks
        self.ns = dict.fromkeys(SIDES, 0)
        self.cpu_ns = 0
        self.hooks = {}
        return ns, cpu_ns, hooks


TOTALS = StepTotals()
"""The process's totals: vLLM builds one scheduler-side and (in-process) one
worker-side connector per engine, and the driver runs one engine per process."""


def _side_of(connector: Any) -> str | None:
    """``scheduler`` or ``worker``, from the role vLLM built the instance for; None
    before the base class's ``__init__`` has stored it."""
    role = connector.__dict__.get("_role")
    if role is None:
        return None
    return "scheduler" if role.name == "SCHEDULER" else "worker"


def _timed(hook: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: Any, /, *args: Any, **kwargs: Any) -> Any:
        side = _side_of(self)
        if side is None or self.__dict__.get("_bench_depth", 0):
            # Not built yet, or a hook inside a hook (the outer call is timing it).
            return method(self, *args, **kwargs)
        self.__dict__["_bench_depth"] = 1
        # The CPU clock is a system call (~1.6 us hot on this project's 2-core VM,
        # more cold; perf_counter_ns ~0.08 us), read outside the wall interval so the
        # wall figure does not carry it. The CPU interval carries about one read (the
        # opening one's return, the closing one's entry); a second closing read
        # measures that in CPU time, where it happens, and it is taken off.
        cpu_start = time.thread_time_ns()
        start = time.perf_counter_ns()
        try:
            return method(self, *args, **kwargs)
        finally:
            end = time.perf_counter_ns()
            cpu_end = time.thread_time_ns()
            clock = time.thread_time_ns() - cpu_end
            TOTALS.cpu_ns += cpu_end - cpu_start - clock
            elapsed = end - start
            self.__dict__["_bench_depth"] = 0
            TOTALS.ns[side] += elapsed
            calls, total = TOTALS.hooks.get((side, hook), (0, 0))
            TOTALS.hooks[(side, hook)] = (calls + 1, total + elapsed)

    return wrapper


def timed_connector_class(base: type, name: str) -> type:
    """``base`` with every hook (:func:`hook_names`) timed; named ``name``.

    Built with ``type()`` so the base may be any connector class (vLLM's or
    ours), known only at run time.
    """
    namespace: dict[str, Any] = {"__module__": __name__, "__doc__": f"{base.__name__}, timed."}
    for hook in hook_names(base):
        namespace[hook] = _timed(hook, getattr(base, hook))
    return type(name, (base,), namespace)
