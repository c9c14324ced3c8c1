"""A history's samples read as time series: per engine incarnation, and leases against requests.

A prefill engine's lease counters start at zero with each incarnation, so
each incarnation is its own series. The run-wide view sums the prefill
engines' leases (held + granted: every lease whose blocks P keeps) and sets
them against the requests that explain them: a request explains a lease while
its client waits, and for ``orphan_s`` after its client hung up or got an
error (its unclaimed lease lives until the lease's end).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

from kvproto_tools.chaos.history import History, Sample
from kvproto_tools.chaos.schedule import PREFILLS

HELD = "vllm:kvproto_holder_leases_held"
GRANTED = "vllm:kvproto_holder_leases_granted"
PUMP_GAP = "vllm:kvproto_worker_pump_gap_ms_max"


@dataclass(frozen=True, slots=True)
class Point:
    """One engine incarnation's figures at one sample."""

    t: float
    """When its scrape ended (the figures are at most this old plus one engine step)."""
    metrics: dict[str, float]
    """Its figures."""


def incarnations(history: History) -> dict[tuple[str, int], list[Point]]:
    """(engine, incarnation) -> its answered samples, in time order."""
    out: dict[tuple[str, int], list[Point]] = {}
    for sample in history.samples:
        for e in sample.engines:
            if e.metrics is not None:
                out.setdefault((e.name, e.incarnation), []).append(Point(sample.t1, e.metrics))
    return out


def leases(sample: Sample) -> float:
    """Leases the prefill engines keep at ``sample`` (an engine that did not answer: none,
    its memory is gone or it is restarting)."""
    return sum(
        e.metrics.get(HELD, 0.0) + e.metrics.get(GRANTED, 0.0)
        for e in sample.engines
        if e.name in PREFILLS and e.metrics is not None
    )


def held(sample: Sample, engines: tuple[str, ...] = PREFILLS) -> float:
    """Leases claimed by a reader on ``engines`` at ``sample``."""
    return sum(
        e.metrics.get(HELD, 0.0)
        for e in sample.engines
        if e.name in engines and e.metrics is not None
    )


class Explained:
    """How many leases the client's requests explain at a sample."""

    def __init__(self, history: History, orphan_s: float) -> None:
        self._sent = sorted(s.sent for s in history.sent)
        self._ended = sorted(
            s.ended + (orphan_s if s.outcome != "ok" else 0.0) for s in history.sent
        )

    def at(self, sample: Sample) -> int:
        """Requests live at any moment of the sample's scrape (sent by its end, not ended
        by its start), each explaining one lease (n > 1: one lease for its children)."""
        sent = bisect.bisect_right(self._sent, sample.t1)
        ended = bisect.bisect_left(self._ended, sample.t0)
        return sent - ended


def unexplained(history: History, orphan_s: float) -> Iterator[tuple[Sample, float]]:
    """Every sample with the leases no request explains there (0 when all are)."""
    explained = Explained(history, orphan_s)
    for sample in history.samples:
        yield sample, max(0.0, leases(sample) - explained.at(sample))


def pump_gap_s(history: History, t0: float, t1: float) -> float:
    """The longest prefill pump gap any sample in ``[t0, t1]`` reports, in seconds."""
    gaps = [
        e.metrics.get(PUMP_GAP, 0.0) / 1000.0
        for s in history.samples
        if t0 <= s.t1 and s.t0 <= t1
        for e in s.engines
        if e.name in PREFILLS and e.metrics is not None
    ]
    return max(gaps, default=0.0)


def scrape_s(history: History, t0: float, t1: float) -> float:
    """One sample period plus the longest scrape in ``[t0, t1]``."""
    longest = max((s.t1 - s.t0 for s in history.samples if t0 <= s.t1 and s.t0 <= t1), default=0.0)
    return history.sample_s + longest
