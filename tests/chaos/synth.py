"""Chaos-run histories made up for the checker's tests: a clean one, then each test breaks it.

:func:`clean_history` answers every planned request correctly half a second
after it was sent, and samples every engine every quarter second: each
prefill engine grants a lease 0.1 s after a request (alternating engines) and
frees it DONE 0.1 s before the answer, so its leases never exceed the
requests in flight; memory is flat, the decoder tracks nothing at the end.
The helpers change the samples from a moment on, as a real fault would.
"""

from __future__ import annotations

import bisect

import msgspec

from examples.pd_cpu.tiny_model import CORPUS
from kvproto_tools.chaos.answers import Choice
from kvproto_tools.chaos.baseline import Expected, key_of
from kvproto_tools.chaos.history import EngineSample, History, Injected, Sample, Sent
from kvproto_tools.chaos.schedule import DECODE, PREFILLS, make_schedule

H = "vllm:kvproto_holder_"
RATE, WARMUP, LEASE = 1.0, 20.0, 10
ANSWER_S = 0.5
RSS = 1 << 30


def answer(index: int) -> Choice:
    """What request ``index`` is answered with (the baseline's too): two tokens, each
    drawn from a distribution of its own."""
    return Choice(
        text=f"answer {index}",
        token_ids=(index, index + 1),
        tokens=("answer", f" {index}"),
        top_logprobs=((-0.5, -1.5, -2.0), (-0.25 - index / 1e4, -3.0)),
    )


def clean_history(duration_s: float = 600.0, seed: int = 3) -> tuple[History, dict[str, Expected]]:
    """A run where everything went right, and the plain engine's answers."""
    plan = make_schedule(
        seed, duration_s, sentences=CORPUS, lease_s=LEASE, rate=RATE, warmup_s=WARMUP
    )
    history = History(
        plan=plan, rate=RATE, warmup_s=WARMUP, sample_s=0.25, layout="made up for a test"
    )
    expected: dict[str, Expected] = {}
    for req in plan.requests:
        # A repeated prompt asks the same question: the first answer is the baseline's.
        want = expected.setdefault(key_of(req), Expected(choices=(answer(req.index),) * req.n))
        history.sent.append(
            Sent(
                index=req.index,
                sent=req.at,
                ended=req.at + ANSWER_S,
                outcome="ok",
                choices=want.choices,
            )
        )
    history.load_end = duration_s
    history.end = duration_s + 5.0
    t = 0.0
    while t <= history.end:
        history.samples.append(_sample(history, t))
        t += history.sample_s
    return history, expected


def _sample(history: History, t: float) -> Sample:
    engines = []
    for k, name in enumerate(PREFILLS):
        mine = history.sent[k :: len(PREFILLS)]
        grants = bisect.bisect_right([s.sent + 0.1 for s in mine], t)
        done = bisect.bisect_right([s.ended - 0.1 for s in mine], t)
        metrics = {
            f"{H}grants_total": float(grants),
            f"{H}released_done_total": float(done),
            f"{H}leases_granted": float(grants - done),
            f"{H}leases_held": 0.0,
            f"{H}sessions": 1.0,
            "vllm:kv_cache_usage_perc": 0.0,
            "vllm:kvproto_worker_pump_gap_ms_max": 20.0,
        }
        engines.append(EngineSample(name=name, incarnation=1, metrics=metrics, rss_bytes=RSS))
    reader = {
        "vllm:kvproto_reader_requests": 0.0,
        "vllm:kvproto_reader_pending_reads": 0.0,
        "vllm:kvproto_reader_sessions": 2.0,
    }
    engines.append(EngineSample(name=DECODE, incarnation=1, metrics=reader, rss_bytes=RSS))
    return Sample(t0=t, t1=t + 0.01, engines=tuple(engines))


def change(
    history: History,
    engine: str,
    name: str,
    *,
    by: float = 0.0,
    to: float | None = None,
    start: float,
    end: float = float("inf"),
) -> None:
    """Add ``by`` to (or set ``to``) ``engine``'s figure ``name`` in the samples of
    ``[start, end)``."""
    for i, sample in enumerate(history.samples):
        if not start <= sample.t0 < end:
            continue
        engines = []
        for e in sample.engines:
            if e.name != engine or e.metrics is None:
                engines.append(e)
                continue
            value = e.metrics.get(name, 0.0) + by if to is None else to
            engines.append(msgspec.structs.replace(e, metrics={**e.metrics, name: value}))
        history.samples[i] = msgspec.structs.replace(sample, engines=tuple(engines))


def inject(history: History, index: int, start: float, end: float) -> Injected:
    """Record the plan's fault ``index`` as applied over ``[start, end]``."""
    done = Injected(fault=history.plan.faults[index], start=start, end=end)
    history.injected.append(done)
    return done


def first(history: History, kind: str) -> int:
    """The index of the plan's first fault of ``kind``."""
    return next(f.index for f in history.plan.faults if f.kind == kind)
