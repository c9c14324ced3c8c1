"""The run's settling wait, with a stand-in clock and samples (no deployment)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from kvproto_tools.chaos.driver import _Run
from kvproto_tools.chaos.history import EngineSample, Sample

GRANTED = "vllm:kvproto_holder_leases_granted"


def _sample(t0: float, granted: float) -> Sample:
    engine = EngineSample(name="prefill-0", incarnation=1, metrics={GRANTED: granted})
    return Sample(t0=t0, t1=t0 + 0.05, engines=(engine,))


def test_settling_waits_for_a_sample_begun_after_it_started() -> None:
    """A sample that began before the wait (while the last request was served) says nothing
    about the end: the run's last answer may have come after its scrape of that engine."""
    started = time.monotonic()
    samples = [_sample(0.0, 0.0)]  # clean, but begun before the wait
    run = SimpleNamespace(
        history=SimpleNamespace(samples=samples, sample_s=0.01),
        clock=lambda: time.monotonic() - started,
    )
    later = threading.Timer(0.3, lambda: samples.append(_sample(run.clock(), 0.0)))
    later.start()
    _Run.settle(run, 5.0)  # type: ignore[arg-type]
    waited = time.monotonic() - started
    later.join()
    assert 0.3 <= waited < 2.0, waited


def test_settling_returns_at_its_bound_when_a_lease_stays() -> None:
    started = time.monotonic()
    run = SimpleNamespace(
        history=SimpleNamespace(samples=[_sample(1.0, 1.0)], sample_s=0.01),
        clock=lambda: time.monotonic() - started,
    )
    _Run.settle(run, 0.2)  # type: ignore[arg-type]
    assert 0.2 <= time.monotonic() - started < 1.0
