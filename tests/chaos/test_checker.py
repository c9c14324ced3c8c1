"""The chaos checker on made-up histories: clean passes, and each broken property is caught.

Every test starts from :func:`synth.clean_history` (600 s of load, every answer
right, every lease freed DONE, memory flat) and breaks one thing the way a
bug or a fault would show it in the samples.
"""

from __future__ import annotations

import math

import msgspec
import pytest

from kvproto_tools.chaos.bounds import Terms, peer_lost_s
from kvproto_tools.chaos.checker import (
    JUDGED_SPAN_S,
    RSS_GROWTH_LIMIT,
    TEAR_S,
    Verdict,
    check,
)
from kvproto_tools.chaos.history import Exit, History
from kvproto_tools.chaos.schedule import DECODE

from .synth import RSS, H, change, clean_history, first, inject

P0, P1 = "prefill-0", "prefill-1"


def checks(history: History, expected: dict) -> set[str]:  # type: ignore[type-arg]
    return {v.check for v in check(history, expected).violations}


def test_a_clean_history_is_clean() -> None:
    history, expected = clean_history()
    verdict = check(history, expected)
    assert verdict.violations == []
    assert verdict.answers["wrong"] == 0 and verdict.answers["ok"] == len(history.sent)
    assert verdict.ended["released_done"] == len(history.sent)
    rss = verdict.slopes[f"rss {P0}#1"]
    assert rss.per_min == 0.0 and rss.mean == RSS


def _answered(history: History, k: int, **changed: object) -> None:
    """Request ``k``'s first choice changed as ``changed`` says."""
    sent = history.sent[k]
    first = msgspec.structs.replace(sent.choices[0], **changed)
    history.sent[k] = msgspec.structs.replace(sent, choices=(first, *sent.choices[1:]))


@pytest.mark.parametrize(
    "changed",
    [
        # A token from another distribution: a wrong KV block changes it from the start.
        {"tokens": ("answer", " other"), "top_logprobs": ((-0.5, -1.5, -2.0), (-0.9, -1.1))},
        # The same distribution where the tokens part, but not before: wrong too.
        {"tokens": ("answer", " other"), "top_logprobs": ((-0.7, -1.5, -2.0), (-0.25, -3.0))},
        # Equal tokens but another text or other ids: the detokenizer or the ids disagree.
        {"text": "answer that differs"},
        {"token_ids": (7, 7)},
        # No log-probabilities returned, and another text: nothing shows it was right.
        {"tokens": None, "top_logprobs": None, "text": "answer that differs"},
    ],
)
def test_one_wrong_token_is_caught(changed: dict[str, object]) -> None:
    history, expected = clean_history()
    k = len(history.sent) // 2
    _answered(history, k, **changed)
    verdict = check(history, expected)
    assert verdict.answers["wrong"] == 1
    assert [v.check for v in verdict.violations] == ["answers"]


def test_a_token_drawn_differently_from_the_same_distribution_is_right() -> None:
    history, expected = clean_history()
    k = len(history.sent) // 2
    top = history.sent[k].choices[0].top_logprobs
    assert top is not None
    # Float rounding of another batch: every log-probability 4e-4 off, and the draw at the
    # second token landed on the other side of an edge.
    moved = tuple(tuple(x + 4e-4 for x in row) for row in top)
    _answered(history, k, tokens=("answer", " other"), text="answer other", top_logprobs=moved)
    verdict = check(history, expected)
    assert verdict.violations == []
    assert verdict.answers["drawn"] == 1 and verdict.answers["wrong"] == 0
    assert verdict.logprob_delta == pytest.approx(4e-4)


def test_an_error_or_a_hang_up_is_not_a_wrong_answer() -> None:
    history, expected = clean_history()
    for k, outcome in ((3, "error"), (4, "cancelled")):
        history.sent[k] = msgspec.structs.replace(history.sent[k], outcome=outcome, choices=())
    verdict = check(history, expected)
    assert verdict.violations == []
    assert verdict.answers["error"] == 1 and verdict.answers["cancelled"] == 1


def test_an_exit_nobody_scheduled_is_a_crash_and_a_failed_restart_too() -> None:
    history, expected = clean_history()
    history.exits.append(Exit(t=50.0, name=DECODE, returncode=-9, scheduled=True))
    assert checks(history, expected) == set()
    history.exits.append(Exit(t=60.0, name=P1, returncode=-11, scheduled=False, log_tail="x"))
    assert checks(history, expected) == {"processes"}
    history, expected = clean_history()
    done = inject(history, first(history, "kill-prefill"), 100.0, 140.0)
    history.injected[-1] = msgspec.structs.replace(done, restarted=False, detail="not healthy")
    assert checks(history, expected) == {"processes"}


def test_a_lease_ended_twice_is_caught_but_torn_scrapes_are_not() -> None:
    history, expected = clean_history()
    # The gauges read before the counters for a few samples, then the two agree again.
    change(history, P0, f"{H}released_done_total", by=1, start=100.0, end=100.25)
    change(history, P1, f"{H}grants_total", by=-1, start=150.0, end=150.0 + TEAR_S - 1.0)
    assert checks(history, expected) == set()
    change(history, P0, f"{H}released_done_total", by=1, start=200.0)
    verdict = check(history, expected)
    assert {v.check for v in verdict.violations} == {"leases"}
    assert "ended twice or never" in verdict.violations[0].detail
    assert verdict.violations[0].t == pytest.approx(200.0 + TEAR_S, abs=0.5)
    history, expected = clean_history()
    change(history, P1, f"{H}grants_total", by=1, start=history.samples[-1].t0)
    assert checks(history, expected) == {"leases"}  # off at the end: no later sample


def _ended_at(history: History, engine: str, reason: str, t: float, n: int = 1) -> None:
    """``n`` more leases granted at ``t - 1`` and ended for ``reason`` at ``t``."""
    change(history, engine, f"{H}grants_total", by=n, start=t - 1.0)
    change(history, engine, f"{H}leases_granted", by=n, start=t - 1.0, end=t)
    change(history, engine, f"{H}{reason}_total", by=n, start=t)


def test_an_expiry_nothing_explains_is_caught() -> None:
    history, expected = clean_history()
    _ended_at(history, P0, "expired", 300.0)
    assert "leases" in checks(history, expected)


def test_an_expiry_a_partition_or_a_client_explains_is_not() -> None:
    history, expected = clean_history()
    inject(history, first(history, "partition"), 100.0, 115.0)
    _ended_at(history, P1, "expired", 110.0)
    k = next(i for i, s in enumerate(history.sent) if s.sent > 300.0)
    history.sent[k] = msgspec.structs.replace(history.sent[k], outcome="error", choices=())
    _ended_at(history, P0, "expired", history.sent[k].ended + 9.0)
    assert checks(history, expected) == set()


@pytest.mark.parametrize(
    ("reason", "fault"), [("peer_lost", "kill-prefill"), ("revoked", "kill-decode")]
)
def test_an_end_the_fault_there_does_not_explain_is_caught(reason: str, fault: str) -> None:
    history, expected = clean_history()
    inject(history, first(history, fault), 100.0, 130.0)
    _ended_at(history, P0, reason, 101.0)
    assert checks(history, expected) == {"leases"}


def _strand(history: History, start: float, end: float, n: int = 4) -> None:
    """``n`` leases on P1 that no request explains over ``[start, end)``, then expired."""
    change(history, P1, f"{H}grants_total", by=n, start=start)
    change(history, P1, f"{H}leases_granted", by=n, start=start, end=end)
    change(history, P1, f"{H}expired_total", by=n, start=end)


def test_stranded_leases_outside_every_fault_window_are_caught() -> None:
    history, expected = clean_history()
    _strand(history, 200.0, 230.0)
    verdict = check(history, expected)
    assert {v.check for v in verdict.violations} == {"reclaim", "leases"}


def test_leases_stranded_by_a_fault_must_go_within_its_settle_bound() -> None:
    history, expected = clean_history()
    done = inject(history, first(history, "partition"), 100.0, 115.0)
    _strand(history, 105.0, 124.0)  # gone 9 s after the heal: inside d + backoff + ...
    verdict = check(history, expected)
    assert verdict.violations == []
    (reclaim,) = verdict.reclaims
    assert 8.5 < reclaim.settle_s < 9.5 < reclaim.settle_bound_s
    # The bound from its parts: d, one pump gap, one scrape, TCP's wait after the cut.
    assert reclaim.settle_bound_s == pytest.approx(
        10.0 + 0.02 + 0.25 + 0.01 + min(done.fault.length_s + 1.0, 120.0)
    )
    history, expected = clean_history()
    inject(history, first(history, "partition"), 100.0, 115.0)
    _strand(history, 105.0, 115.0 + reclaim.settle_bound_s + 2.0)
    verdict = check(history, expected)
    assert "reclaim" in {v.check for v in verdict.violations}


@pytest.mark.parametrize(("freed_after", "caught"), [(0.5, False), (3.0, True)])
def test_a_killed_decoder_s_claimed_leases_must_go_peer_lost_within_detection(
    freed_after: float, caught: bool
) -> None:
    history, expected = clean_history()
    inject(history, first(history, "kill-decode"), 100.0, 140.0)
    # Two requests waiting on D when it dies: their clients get errors, their leases go.
    waiting = [i for i, s in enumerate(history.sent) if 95.0 <= s.sent < 100.0][:2]
    for k in waiting:
        history.sent[k] = msgspec.structs.replace(
            history.sent[k], ended=100.2, outcome="error", choices=()
        )
    change(history, P0, f"{H}grants_total", by=2, start=97.0)
    change(history, P0, f"{H}leases_held", by=2, start=97.0, end=100.0 + freed_after)
    change(history, P0, f"{H}peer_lost_total", by=2, start=100.0 + freed_after)
    verdict = check(history, expected)
    (reclaim,) = verdict.reclaims
    assert reclaim.held_at_start == 2
    assert reclaim.freed_s == pytest.approx(freed_after, abs=0.3)
    terms = Terms(pump_gap_s=0.02, scrape_s=0.26)  # the made-up pump gap, a scrape
    assert reclaim.freed_bound_s == pytest.approx(peer_lost_s(terms))
    assert ("reclaim" in {v.check for v in verdict.violations}) is caught


@pytest.mark.parametrize(
    ("engine", "name", "value"),
    [
        (P0, f"{H}leases_held", 1.0),
        (P1, "vllm:kv_cache_usage_perc", 0.02),
        (P0, f"{H}sessions", 2.0),
        (DECODE, "vllm:kvproto_reader_requests", 1.0),
        (DECODE, "vllm:kvproto_reader_sessions", 3.0),
    ],
)
def test_what_is_left_at_the_end_is_caught(engine: str, name: str, value: float) -> None:
    history, expected = clean_history()
    last = history.samples[-1].t0
    change(history, engine, name, to=value, start=last)
    if name.endswith("leases_held"):
        change(history, engine, f"{H}grants_total", by=value, start=last)
    assert "end state" in checks(history, expected)


def _grow(history: History, engine: str, per_min: float, *, settles_s: float = 0.0) -> None:
    """``engine``'s memory grows ``per_min`` bytes a minute, for good or (``settles_s``)
    decaying like a warm-up with that time constant."""
    for i, sample in enumerate(history.samples):
        t = sample.t0
        grown = per_min * (t if not settles_s else settles_s * (1 - math.exp(-t / settles_s)))
        engines = tuple(
            msgspec.structs.replace(e, rss_bytes=int(RSS + grown / 60.0)) if e.name == engine else e
            for e in sample.engines
        )
        history.samples[i] = msgspec.structs.replace(sample, engines=engines)


def test_memory_that_keeps_growing_is_caught_only_over_a_long_enough_stretch() -> None:
    history, expected = clean_history()
    _grow(history, DECODE, per_min=8 * 2**20)  # 0.8 % of 1 GiB a minute
    verdict = check(history, expected)
    assert {v.check for v in verdict.violations} == {"growth"}
    assert verdict.slopes[f"rss {DECODE}#1"].per_min == pytest.approx(8 * 2**20)
    short, expected = clean_history(duration_s=60.0 + JUDGED_SPAN_S / 2)
    _grow(short, DECODE, per_min=8 * 2**20)
    assert checks(short, expected) == set()  # printed, not judged


def test_a_warm_up_that_settles_is_not_growth() -> None:
    history, expected = clean_history()
    # 30 MiB/min at first, decaying with a 100 s time constant: ~0.1 MiB/min by 600 s.
    _grow(history, P1, per_min=30 * 2**20, settles_s=100.0)
    verdict = check(history, expected)
    assert verdict.violations == []
    fit = verdict.slopes[f"rss {P1}#1"]
    assert fit.high < RSS_GROWTH_LIMIT * fit.mean


def test_a_schedule_the_seed_does_not_give_or_faults_out_of_order_are_caught() -> None:
    history, expected = clean_history()
    history.plan = msgspec.structs.replace(history.plan, seed=history.plan.seed + 1)
    assert checks(history, expected) == {"schedule"}
    history, expected = clean_history()
    inject(history, 2, 100.0, 110.0)
    inject(history, 1, 150.0, 160.0)
    assert "schedule" in checks(history, expected)


def test_verdict_round_trips_as_json() -> None:
    history, expected = clean_history(duration_s=120.0)
    verdict = check(history, expected)
    again = msgspec.json.decode(msgspec.json.encode(verdict), type=Verdict)
    assert again.answers == verdict.answers and again.slopes == verdict.slopes


def test_a_kill_with_nothing_claimed_has_no_free_time() -> None:
    history, expected = clean_history()
    inject(history, first(history, "kill-decode"), 100.0, 140.0)
    (reclaim,) = check(history, expected).reclaims
    assert reclaim.held_at_start == 0 and reclaim.freed_s is None
