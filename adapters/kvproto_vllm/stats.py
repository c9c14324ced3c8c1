"""Lease counters and gauges through vLLM's connector stats and Prometheus hooks.

Flow (vllm-api.md section 5): each worker's ``get_kv_connector_stats`` returns
a :class:`KvprotoStats` holding the *deltas* of the core's counters since the
last call plus the current gauges of that rank; vLLM aggregates ranks and
steps with :meth:`KvprotoStats.aggregate`, the front end logs
:meth:`KvprotoStats.reduce` and feeds :class:`KvprotoPromMetrics`. Counters
add up; a gauge is the last value per rank, summed over ranks, so
aggregating steps does not multiply it. Stats only flow while the engine
steps and only with stats logging on (``disable_log_stats=False``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

GAUGES = frozenset(
    {
        "holder_leases_granted",
        "holder_leases_held",
        "holder_sessions",
        "holder_tombstones",
        "holder_leases_quarantined",
        "reader_pending_reads",
        "reader_requests",
        "reader_sessions",
        "worker_pump_gap_ms_max",
    }
)
"""Snapshot keys that are levels, not counts."""

PROM_PREFIX = "vllm:kvproto_"

# What Prometheus exports: the decisions an operator watches. Other counters
# still reach the periodic log line through reduce().
PROM_COUNTERS: dict[str, str] = {
    "holder_grants": "Leases granted by this prefill engine.",
    "holder_released_done": "Leases freed because every reader finished.",
    "holder_expired": "Leases freed because no heartbeat kept them alive.",
    "holder_aborted": "Leases freed because the reader gave the request up.",
    "holder_peer_lost": "Leases freed because the reader's transport peer was lost.",
    "holder_revoked": "Leases revoked locally.",
    "holder_max_hold": "Leases freed at the hard hold cap.",
    "holder_late_done": "Done frames that arrived after the lease ended (reads fenced).",
    "holder_bad_proof": "Frames with a wrong lease proof (refused).",
    "holder_malformed": "Frames that did not parse (dropped).",
    "holder_rate_limited": "Frames dropped by the per-peer rate limit.",
    "holder_legacy_frames": "Stock NixlConnector text frames applied (interop mode).",
    "holder_heartbeats": "Heartbeat frames applied.",
    "reader_tracked": "Requests tracked from enqueue.",
    "reader_heartbeats_sent": "Heartbeat frames sent.",
    "reader_reads_confirmed": "Reads confirmed HELD by every holder rank.",
    "reader_declined": "Reads not started because the lease might end first.",
    "reader_deferred": "Reads put off one heartbeat round trip: the deadline bound was stale.",
    "reader_fenced": "Reads discarded because the holder answered LATE or not at all.",
    "reader_lost": "Requests failed because the holder no longer held the lease.",
    "reader_failed_recving": "Requests reported to vLLM as failed loads (recomputed).",
    "reader_handshake_failures": "Side-channel handshakes that failed.",
    "reader_compat_mismatches": "Handshakes refused for incompatible engines.",
    "reader_fanout_done_timeouts": (
        "Lease dones held back ack_timeout for a request on the same ticket (a parallel-"
        "sampling child) that had not begun its read, then sent without it."
    ),
    "push_registrations": "Push mode, D: registrations of granted blocks sent to P ranks.",
    "push_fenced": "Push mode, D: writable leases that ended while a write could still land.",
    "push_written": "Push mode, P: writes D confirmed (its done found the lease held).",
    "push_write_failures": "Push mode, P: writes that failed, were declined or never began.",
    "push_bad_registrations": "Push mode, P: registrations that did not decode (dropped).",
}
PROM_GAUGES: dict[str, str] = {
    "holder_leases_granted": "Leases granted and not yet claimed by a reader.",
    "holder_leases_held": "Leases claimed and kept alive by heartbeats.",
    "holder_sessions": "Reader sessions of this prefill engine.",
    "holder_tombstones": "Ended leases remembered to answer a late done (tombstone_ttl).",
    "reader_pending_reads": "Planned reads without a verdict yet.",
    "reader_requests": "Requests tracked now (their leases heartbeated).",
    "reader_sessions": "Holder sessions of this decode engine.",
    "worker_pump_gap_ms_max": (
        "Longest gap between two polls of the lease cores in the last stats interval, ms: "
        "how late a due heartbeat or done verdict can be (engine step time)."
    ),
}


def _is_peak(key: str) -> bool:
    return key.endswith("_max")


class DeltaTracker:
    """Turns cumulative snapshots into per-interval deltas (counters) and levels (gauges).

    vLLM asks at every engine step. A worker's snapshot keeps its keys in one
    order, and between two steps its counters have almost always not moved:
    that is checked as one tuple comparison (C speed) before any per-key work,
    which is then done only for a step that changed something."""

    def __init__(self, rank_key: str) -> None:
        self.rank_key = rank_key
        self._last: dict[str, int] = {}
        self._last_gauges: dict[str, int] | None = None
        self._layouts: dict[tuple[str, ...], _Layout] = {}
        self._seen: tuple[tuple[str, ...], tuple[int, ...]] | None = None
        """The key order and counter values of the last snapshot whose counters were applied."""

    def delta(self, snapshot: dict[str, int]) -> KvprotoStats | None:
        keys = tuple(snapshot)
        layout = self._layouts.get(keys)
        if layout is None:
            layout = self._layouts[keys] = _Layout(keys)
        values = tuple(snapshot.values())
        counted = layout.counter_values(values)
        counters: dict[str, int] = {}
        if self._seen != (keys, counted):
            for key, value in zip(layout.counter_keys, counted, strict=True):
                change = value - self._last.get(key, 0)
                if change:
                    counters[key] = change
                self._last[key] = value
            self._seen = (keys, counted)
        gauges = dict(zip(layout.gauge_keys, layout.gauge_values(values), strict=True))
        if not counters and gauges == self._last_gauges:
            return None
        self._last_gauges = gauges
        return KvprotoStats(data={"counters": counters, "gauges": {self.rank_key: gauges}})


class _Layout:
    """Where a snapshot of one key order keeps its counters and its gauges."""

    __slots__ = ("counter_keys", "counter_values", "gauge_keys", "gauge_values")

    def __init__(self, keys: tuple[str, ...]) -> None:
        counters = [i for i, key in enumerate(keys) if key not in GAUGES]
        gauges = [i for i, key in enumerate(keys) if key in GAUGES]
        self.counter_keys = tuple(keys[i] for i in counters)
        self.gauge_keys = tuple(keys[i] for i in gauges)
        self.counter_values = _picker(counters)
        self.gauge_values = _picker(gauges)


def _picker(positions: list[int]) -> Callable[[tuple[int, ...]], tuple[int, ...]]:
    """``values -> tuple(values[i] for i in positions)``, as one C call where it can be."""
    if len(positions) >= 2:
        return cast(Callable[[tuple[int, ...]], tuple[int, ...]], itemgetter(*positions))
    if positions:
        only = positions[0]
        return lambda values: (values[only],)
    return lambda values: ()


@dataclass
class KvprotoStats(KVConnectorStats):
    """``data = {"counters": {name: delta}, "gauges": {rank_key: {name: level}}}``."""

    def __post_init__(self) -> None:
        self.data.setdefault("counters", {})
        self.data.setdefault("gauges", {})

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> KvprotoStats:
        counters = dict(self.data.get("counters", {}))
        for key, value in other.data.get("counters", {}).items():
            counters[key] = counters.get(key, 0) + value
        gauges = {k: dict(v) for k, v in self.data.get("gauges", {}).items()}
        for rank, levels in other.data.get("gauges", {}).items():
            merged = gauges.setdefault(rank, {})
            for key, value in levels.items():
                # A level is the newest value; a "_max" gauge keeps the interval's peak.
                merged[key] = max(merged.get(key, value), value) if _is_peak(key) else value
        self.data = {"counters": counters, "gauges": gauges}
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key, value in sorted(self.data.get("counters", {}).items()):
            out[key] = value
        for key, value in sorted(self.gauge_totals().items()):
            out[key] = value
        return out

    def gauge_totals(self) -> dict[str, int]:
        """Each level summed over ranks; each peak ("_max") the largest over ranks."""
        totals: dict[str, int] = {}
        for per_rank in self.data.get("gauges", {}).values():
            for key, value in per_rank.items():
                if _is_peak(key):
                    totals[key] = max(totals.get(key, value), value)
                else:
                    totals[key] = totals.get(key, 0) + value
        return totals

    def is_empty(self) -> bool:
        return not self.data.get("counters") and not self.data.get("gauges")


class KvprotoPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvproto_*`` counters and gauges, one child per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, doc in PROM_COUNTERS.items():
            metric = self._counter_cls(
                name=PROM_PREFIX + name, documentation=doc, labelnames=labelnames
            )
            self._counters[name] = create_metric_per_engine(metric, per_engine_labelvalues)
        self._gauges: dict[str, dict[int, Any]] = {}
        for name, doc in PROM_GAUGES.items():
            # vLLM's Gauge class takes multiprocess_mode; the generic type hides it.
            gauge_cls: Any = self._gauge_cls
            metric = gauge_cls(
                name=PROM_PREFIX + name,
                documentation=doc,
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
            self._gauges[name] = create_metric_per_engine(metric, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        stats = KvprotoStats(data=dict(transfer_stats_data))
        for key, value in stats.data["counters"].items():
            children = self._counters.get(key)
            if children is not None and value > 0 and engine_idx in children:
                children[engine_idx].inc(value)
        for key, value in stats.gauge_totals().items():
            children = self._gauges.get(key)
            if children is not None and engine_idx in children:
                children[engine_idx].set(value)
