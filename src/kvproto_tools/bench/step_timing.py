"""Time a KV connector's hooks from inside vLLM's own engine step (the ``vllm-step`` suite).

:func:`timed_connector_class` derives a class from a connector whose hook
methods add their ``perf_counter_ns`` time to a per-role total; the engine
driver (:mod:`.step_engine`) reads and resets the totals around each
``LLMEngine.step()``, so one sample is what the connector cost that step,
scheduler side and worker side. Nothing of vLLM is patched: the derived class
is loaded by vLLM's connector factory through ``kv_connector_module_path``
(:mod:`.step_connectors`), and every call still runs the real hook.

A hook that calls another hook (stock ``get_finished`` calls
``get_transfer_results``) is counted once: only the outermost call on an
instance adds its time.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

SIDES = ("scheduler", "worker")
"""The two halves vLLM builds a connector as (``KVConnectorRole``)."""

HOOKS: tuple[str, ...] = (
    # scheduler side (Scheduler.schedule / update_from_output / add_request)
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "has_pending_push_work",
    "has_pending_block_frees",
    "take_events",
    "get_loaded_kv_cache_group_ids",
    "get_external_cache_hit_sources",
    # worker side (the model runner's KV-connector mixin and the attention layers)
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_kv_cache_events",
    "build_connector_worker_meta",
    "clear_connector_metadata",
    # both sides
    "get_kv_connector_stats",
)
"""Every per-step hook vLLM 0.32 calls on a connector (``__init__``, handshakes and
``shutdown`` are not per step). Hooks a class lacks are skipped."""


class StepTotals:
    """Nanoseconds spent in connector hooks since the last :meth:`take`, per side."""

    def __init__(self) -> None:
        self.ns = dict.fromkeys(SIDES, 0)
        self.hooks: dict[tuple[str, str], tuple[int, int]] = {}
        """(side, hook) -> (calls, ns) since the last take: where a step's time goes."""

    def take(self) -> tuple[dict[str, int], dict[tuple[str, str], tuple[int, int]]]:
        """The per-side totals and per-hook (calls, ns) so far; both reset to zero."""
        ns, hooks = self.ns, self.hooks
        self.ns = dict.fromkeys(SIDES, 0)
        self.hooks = {}
        return ns, hooks


TOTALS = StepTotals()
"""The process's totals: vLLM builds one scheduler-side and (in-process) one
worker-side connector per engine, and the driver runs one engine per process."""


def _side_of(connector: Any) -> str:
    """``scheduler`` or ``worker``, from the role vLLM built the instance for."""
    return "scheduler" if connector.role.name == "SCHEDULER" else "worker"


def _timed(hook: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: Any, /, *args: Any, **kwargs: Any) -> Any:
        depth = self.__dict__.get("_bench_depth", 0)
        if depth:  # a hook inside a hook: the outer call is already timing it
            return method(self, *args, **kwargs)
        self.__dict__["_bench_depth"] = 1
        start = time.perf_counter_ns()
        try:
            return method(self, *args, **kwargs)
        finally:
            elapsed = time.perf_counter_ns() - start
            self.__dict__["_bench_depth"] = 0
            side = _side_of(self)
            TOTALS.ns[side] += elapsed
            calls, total = TOTALS.hooks.get((side, hook), (0, 0))
            TOTALS.hooks[(side, hook)] = (calls + 1, total + elapsed)

    return wrapper


def timed_connector_class(base: type, name: str) -> type:
    """``base`` with every hook in :data:`HOOKS` it has timed; named ``name``.

    Built with ``type()`` so the base may be any connector class (vLLM's or
    ours), known only at run time.
    """
    namespace: dict[str, Any] = {"__module__": __name__, "__doc__": f"{base.__name__}, timed."}
    for hook in HOOKS:
        method = getattr(base, hook, None)
        if callable(method):
            namespace[hook] = _timed(hook, method)
    return type(name, (base,), namespace)
