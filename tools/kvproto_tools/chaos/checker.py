"""The checker of a chaos run's history: what must hold, each a function over the history.

* **schedule**: the seed reproduces the schedule the run ran (its digest), and the
  faults applied are the schedule's, in its order (those that no longer fit before
  the load's end are left out);
* **answers**: every answer a client got equals the plain engine's answer to the same
  request (tokens, text, and token ids where returned), or parts from it only at a token
  drawn from the same next-token distribution (:mod:`.answers`), or the client got an
  error: never a token computed from a wrong KV;
* **processes**: no process of the deployment ended unless the schedule killed it,
  and every killed engine came back;
* **leases** (per prefill engine incarnation, at every sample): every lease granted
  is held, unclaimed, or ended exactly once (grants = the ends by reason + the two
  gauges), and every end other than a confirmed read falls in a window that
  explains it: a fault of a kind that causes it, or a client that hung up or
  failed (:data:`EXPLAINS`);
* **reclaim**: after each fault, P's leases are back to what live requests explain
  within the derived bound (:func:`.bounds.settle_s`); a decoder's kill frees every
  lease it had claimed within :func:`.bounds.peer_lost_s`; a partition longer than
  the lease frees what the cut-off decoder held within the liveness bound; and no
  sample outside a fault's window shows a lease nobody explains;
* **end state**: once the load is over and the leases settled, P keeps no lease and
  no KV block, D tracks nothing, and each side has no more sessions than live peers;
* **growth**: memory of every engine (its process tree) does not grow once the load
  is steady: fitted over the second half of the time each incarnation served (the first
  half holds its warm-up, which decays: a prefill worker grew 27, 10, 5, then 3 MiB/min
  over its first eight minutes of steady load here), over :data:`JUDGED_SPAN_S` or
  more, the lower end of its slope's 95 % interval stays under :data:`RSS_GROWTH_LIMIT`
  of its size per minute; a leak grows as fast in both halves. The cores' table sizes
  are fitted and printed the same way (their bounds are the end state's).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import msgspec

from kvproto_tools.chaos.answers import compare
from kvproto_tools.chaos.baseline import Expected, key_of
from kvproto_tools.chaos.bounds import Terms, orphan_s, peer_lost_s, settle_s
from kvproto_tools.chaos.history import History, Injected
from kvproto_tools.chaos.schedule import DECODE, PREFILLS, digest, kinds_of, make_schedule
from kvproto_tools.chaos.series import (
    Point,
    held,
    incarnations,
    pump_gap_s,
    scrape_s,
    unexplained,
)
from kvproto_tools.chaos.trends import Slope, slope

HOLDER = "vllm:kvproto_holder_"
REASONS = ("released_done", "expired", "aborted", "peer_lost", "revoked", "max_hold")
"""Why a lease ends (P's counters ``vllm:kvproto_holder_<reason>_total``)."""
NETWORK = ("partition", "loss", "flap")
CLIENT = "client"
"""A request whose client hung up or got an error (its window: sent to end + orphan_s)."""
EXPLAINS: dict[str, frozenset[str]] = {
    # A lease no heartbeat reaches: the decoder cut off or dead before its claim
    # arrived, or a request that never reached the decoder (client gone, router error).
    "expired": frozenset({*NETWORK, "kill-decode", "kill-prefill", CLIENT}),
    # The decoder gave the request up: its client left, or it recomputed after a fault.
    "aborted": frozenset({*NETWORK, "kill-decode", "kill-prefill", CLIENT}),
    # The transport reported the decoder gone: killed, or its link down long enough.
    "peer_lost": frozenset({"kill-decode", *NETWORK}),
    # Done frames for a lease already ended: a read that outlived a cut.
    "late_done": frozenset({*NETWORK, "kill-decode"}),
    # Nothing in the schedule revokes or holds a lease 1800 s.
    "revoked": frozenset(),
    "max_hold": frozenset(),
}
"""For each way a lease ends (other than a confirmed read), what may cause it."""
RSS_GROWTH_LIMIT = 0.001
"""Memory may not grow faster than this share of itself per minute (6 % an hour) at the
lower end of its slope's interval."""
TEAR_S = 10.0
"""How long a prefill engine's lease counters may disagree with its gauges before it counts
as a lease ended twice or lost: a scrape can read the gauges of a stats report before its
counters (seen up to 1.8 s in a run; the worker reports at least once a second while it
steps); a real double end or a lost lease keeps them apart for good."""
JUDGED_SPAN_S = 300.0
"""A memory slope over less steady time than this is printed, not judged."""
STEADY_AFTER_S = 60.0
"""An incarnation's first seconds of serving are never part of its slope (start-up)."""


class Violation(msgspec.Struct, frozen=True, kw_only=True):
    """A property that does not hold."""

    check: str
    """Which check (the module doc's names)."""
    t: float | None
    """When (seconds into the run), where it has a moment."""
    detail: str
    """What was seen."""


class Reclaim(msgspec.Struct, frozen=True, kw_only=True):
    """How fast one fault's leases went, against their bounds."""

    fault: int
    """The fault's index."""
    kind: str
    """Its kind."""
    target: tuple[str, ...]
    """Its target."""
    settle_s: float
    """From its end to the last sample with a lease nobody explains (0: none)."""
    settle_bound_s: float
    """The bound on that (:func:`.bounds.settle_s` with the terms measured)."""
    freed_s: float | None = None
    """Kill of D: to P's held leases all gone; long partition: to the cut-off P's."""
    freed_bound_s: float | None = None
    """The bound on ``freed_s`` (PEER_LOST detection, or the liveness bound)."""
    held_at_start: float = 0.0
    """Kill of D, long partition: claimed leases on the prefill engine(s) it cut off, in the
    last sample before it (``freed_s`` is only measured when there were some)."""


class Verdict(msgspec.Struct, kw_only=True):
    """Everything the checker found: the violations and the figures of the report."""

    violations: list[Violation] = msgspec.field(default_factory=list)
    """Every property that did not hold (empty: the run is clean)."""
    digest: str = ""
    """The schedule's digest."""
    answers: dict[str, int] = msgspec.field(default_factory=dict)
    """Requests by outcome, plus ``wrong`` (requests) and ``drawn`` (choices that parted from
    the plain engine's at a token drawn from the same distribution: :mod:`.answers`)."""
    logprob_delta: float = 0.0
    """The largest log-probability difference between the run and the plain engine over the
    tokens of the answers that were right (what float rounding moved)."""
    by_kind: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    """Request kind -> outcome -> count."""
    faults: dict[str, int] = msgspec.field(default_factory=dict)
    """Faults injected by kind."""
    reclaims: list[Reclaim] = msgspec.field(default_factory=list)
    """One per fault."""
    ended: dict[str, int] = msgspec.field(default_factory=dict)
    """Leases by how they ended, every prefill incarnation together."""
    slopes: dict[str, Slope] = msgspec.field(default_factory=dict)
    """``rss <engine>#<incarnation>`` (bytes) and ``<table> <engine>#<incarnation>``."""

    @property
    def clean(self) -> bool:
        """Whether every property held."""
        return not self.violations


def check(history: History, expected: dict[str, Expected]) -> Verdict:
    """Check every property of ``history``; ``expected``: the plain engine's answers."""
    verdict = Verdict(
        digest=digest(history.plan), faults=kinds_of([i.fault for i in history.injected])
    )
    verdict.violations += check_schedule(history)
    verdict.violations += check_answers(history, expected, verdict)
    verdict.violations += check_processes(history)
    verdict.violations += check_leases(history, verdict)
    verdict.violations += check_reclaims(history, verdict)
    verdict.violations += check_end_state(history)
    verdict.violations += check_growth(history, verdict)
    return verdict


def check_schedule(history: History) -> Iterator[Violation]:
    """The seed reproduces the schedule; the faults applied are its own, in order."""
    plan = history.plan
    again = make_schedule(
        plan.seed,
        plan.duration_s,
        sentences=plan.sentences,
        lease_s=plan.lease_s,
        rate=history.rate,
        warmup_s=history.warmup_s,
        fault_kinds=plan.fault_kinds,
    )
    if digest(again) != digest(plan):
        yield Violation(
            check="schedule",
            t=None,
            detail=f"seed {plan.seed} now gives schedule {digest(again)}, "
            f"the run ran {digest(plan)}",
        )
    previous = -1
    for done in history.injected:
        k = done.fault.index
        if not previous < k < len(plan.faults) or done.fault != plan.faults[k]:
            yield Violation(
                check="schedule",
                t=done.start,
                detail=f"fault {k} applied ({done.fault.kind}) is not the schedule's fault {k} "
                f"or comes out of its order",
            )
        previous = k


def check_answers(
    history: History, expected: dict[str, Expected], verdict: Verdict
) -> Iterator[Violation]:
    """Every answer equals the plain engine's answer to the same request."""
    counts = dict.fromkeys(("ok", "error", "cancelled", "wrong", "drawn"), 0)
    deltas: list[float] = []
    for sent in history.sent:
        req = history.request(sent.index)
        counts[sent.outcome] += 1
        kind = verdict.by_kind.setdefault(req.kind, {})
        kind[sent.outcome] = kind.get(sent.outcome, 0) + 1
        if sent.outcome != "ok":
            continue
        want = expected.get(key_of(req))
        if want is None:
            counts["wrong"] += 1
            yield Violation(
                check="answers", t=sent.ended, detail=f"request {req.index}: no baseline"
            )
            continue
        if len(sent.choices) != len(want.choices):
            counts["wrong"] += 1
            yield Violation(
                check="answers",
                t=sent.ended,
                detail=f"request {req.index} ({req.kind}): {len(sent.choices)} choices, the "
                f"plain engine {len(want.choices)}",
            )
            continue
        verdicts = [compare(g, w) for g, w in zip(sent.choices, want.choices, strict=True)]
        deltas += [v.delta for v in verdicts if v.verdict != "wrong"]
        counts["drawn"] += sum(v.verdict == "drawn" for v in verdicts)
        bad = next((i for i, v in enumerate(verdicts) if v.verdict == "wrong"), None)
        if bad is not None:
            counts["wrong"] += 1
            v = verdicts[bad]
            yield Violation(
                check="answers",
                t=sent.ended,
                detail=f"request {req.index} ({req.kind}) choice {bad} answered "
                f"{sent.choices[bad].text!r}, the plain engine {want.choices[bad].text!r} "
                f"(tokens part at {v.position}, log-probabilities {v.delta:.2g} apart up to "
                "there)",
            )
    verdict.answers = counts
    verdict.logprob_delta = max(deltas, default=0.0)


def check_processes(history: History) -> Iterator[Violation]:
    """No process ended unless killed by the schedule; every killed engine came back."""
    for e in history.exits:
        if not e.scheduled:
            yield Violation(
                check="processes",
                t=e.t,
                detail=f"{e.name} exited ({e.returncode}) and nothing killed it; its log ends:\n"
                + e.log_tail,
            )
    for done in history.injected:
        if not done.restarted:
            yield Violation(
                check="processes",
                t=done.end,
                detail=f"{done.fault.target[0]} did not restart: {done.detail}",
            )


def _counter(p: Point, reason: str) -> float:
    return p.metrics.get(f"{HOLDER}{reason}_total", 0.0)


def _conservation(name: str, inc: int, points: list[Point], *, final: float) -> Iterator[Violation]:
    """Grants = ends + live leases, but for a scrape that caught the gauges before the
    counters: a lease ended twice or lost keeps the count off from then on."""
    off_since: float | None = None
    for p in points:
        off = _unbalanced(p)
        if not off:
            off_since = None
            continue
        off_since = p.t if off_since is None else off_since
        if p.t - off_since > TEAR_S or p.t == final:
            yield Violation(
                check="leases",
                t=p.t,
                detail=f"{name}#{inc}: {_counter(p, 'grants'):.0f} granted, {off:+.0f} against "
                f"the ends and the live gauges since {off_since:.2f} s: a lease ended twice "
                "or never",
            )
            return


def _unbalanced(p: Point) -> float:
    """Grants minus every end and every live lease (0: each lease ended at most once)."""
    live = p.metrics.get(f"{HOLDER}leases_held", 0.0) + p.metrics.get(
        f"{HOLDER}leases_granted", 0.0
    )
    return _counter(p, "grants") - sum(_counter(p, r) for r in REASONS) - live


def _windows(history: History, reason: str) -> list[tuple[float, float]]:
    """The moments that may explain a lease ending for ``reason``."""
    causes = EXPLAINS[reason]
    out = [
        (done.start, done.end + _settle_bound(history, done))
        for done in history.injected
        if done.fault.kind in causes
    ]
    if CLIENT in causes:
        orphan = orphan_bound(history)
        out += [(s.sent, s.ended + orphan) for s in history.sent if s.outcome != "ok"]
    return out


def check_leases(history: History, verdict: Verdict) -> Iterator[Violation]:
    """Every lease ends exactly once, with a reason something in the run explains."""
    ended = dict.fromkeys(REASONS, 0)
    windows = {reason: _windows(history, reason) for reason in (*EXPLAINS, "late_done")}
    for (name, inc), points in incarnations(history).items():
        if name not in PREFILLS:
            continue
        yield from _conservation(name, inc, points, final=history.samples[-1].t1)
        for before, after in itertools.pairwise(points):
            for reason, spans in windows.items():
                grew = _counter(after, reason) - _counter(before, reason)
                if grew > 0 and not any(a <= after.t and before.t <= b for a, b in spans):
                    yield Violation(
                        check="leases",
                        t=after.t,
                        detail=f"{name}#{inc}: {grew:.0f} lease(s) {reason} between "
                        f"{before.t:.2f} and {after.t:.2f} s, and nothing there explains it",
                    )
        for reason in REASONS:
            ended[reason] += int(_counter(points[-1], reason))
    verdict.ended = ended


def orphan_bound(history: History) -> float:
    """How long a failed or hung-up request explains a lease, with the run's measured terms."""
    return orphan_s(history.plan.lease_s, _terms(history, 0.0, history.end))


def _terms(history: History, t0: float, t1: float) -> Terms:
    return Terms(pump_gap_s=pump_gap_s(history, t0, t1), scrape_s=scrape_s(history, t0, t1))


def _settle_bound(history: History, done: Injected) -> float:
    """The fault's settle bound with the terms measured over its window."""
    lease_s = history.plan.lease_s
    planned = settle_s(done.fault, lease_s, Terms(pump_gap_s=0.0, scrape_s=0.0))
    return settle_s(done.fault, lease_s, _terms(history, done.start, done.end + planned))


def check_reclaims(history: History, verdict: Verdict) -> Iterator[Violation]:
    """After each fault P's leases return to what live requests explain, within bounds."""
    stranded = [(s, n) for s, n in unexplained(history, orphan_bound(history)) if n > 0]
    spans = []
    for k, done in enumerate(history.injected):
        bound = _settle_bound(history, done)
        spans.append((done.start, done.end + bound))
        after = history.injected[k + 1].start if k + 1 < len(history.injected) else history.end
        last = max((s.t0 for s, _ in stranded if done.start <= s.t0 < after), default=done.end)
        reclaim = Reclaim(
            fault=done.fault.index,
            kind=done.fault.kind,
            target=done.fault.target,
            settle_s=max(0.0, last - done.end),
            settle_bound_s=bound,
            **_freed(history, done),
        )
        verdict.reclaims.append(reclaim)
        if reclaim.settle_s > bound:
            yield Violation(
                check="reclaim",
                t=last,
                detail=f"fault {done.fault.index} ({done.fault.kind}): leases nobody explains "
                f"{reclaim.settle_s:.2f} s after it ended, bound {bound:.2f} s",
            )
        freed, freed_bound = reclaim.freed_s, reclaim.freed_bound_s
        if freed is not None and freed_bound is not None and freed > freed_bound:
            yield Violation(
                check="reclaim",
                t=done.start + freed,
                detail=f"fault {done.fault.index} ({done.fault.kind}): the leases it cut "
                f"off freed {freed:.2f} s after it began, bound {freed_bound:.2f} s",
            )
    for s, n in stranded:
        if not any(a <= s.t0 <= b for a, b in spans):
            yield Violation(
                check="reclaim",
                t=s.t0,
                detail=f"{n:.0f} lease(s) on P that no request and no fault explains",
            )


def _freed(history: History, done: Injected) -> dict[str, float]:
    """Kill of D: when P's claimed leases were all gone; a partition past the lease: when
    the cut-off prefill engine's were (measured only when some were held as it began)."""
    fault = done.fault
    lease_s = history.plan.lease_s
    engines: tuple[str, ...]
    if fault.kind == "kill-decode":
        engines = PREFILLS
    elif fault.kind == "partition" and fault.length_s >= lease_s:
        engines = fault.target[:1]
    else:
        return {}
    before = [s for s in history.samples if s.t1 <= done.start]
    at_start = held(before[-1], engines) if before else 0.0
    gone = next(
        (s.t1 for s in history.samples if s.t0 >= done.start and held(s, engines) == 0), None
    )
    if not at_start or gone is None:
        return {"held_at_start": at_start}
    terms = _terms(history, done.start, gone)
    if fault.kind == "kill-decode":
        bound = peer_lost_s(terms)
    else:
        # Liveness: freed by max(t_last + e, grant + d) <= cut + d, one pump gap, one scrape.
        bound = lease_s + terms.pump_gap_s + terms.scrape_s
    return {"freed_s": gone - done.start, "freed_bound_s": bound, "held_at_start": at_start}


def check_end_state(history: History) -> Iterator[Violation]:
    """After the load and the settling: no lease, no KV block on P; nothing tracked on D."""
    if not history.samples:
        yield Violation(check="end state", t=None, detail="no sample was taken")
        return
    last = history.samples[-1]
    limits = {
        **{(p, f"{HOLDER}{g}"): 0.0 for p in PREFILLS for g in ("leases_held", "leases_granted")},
        **{(p, "vllm:kv_cache_usage_perc"): 0.0 for p in PREFILLS},
        **{(p, f"{HOLDER}sessions"): 1.0 for p in PREFILLS},  # one decoder rank
        (DECODE, "vllm:kvproto_reader_requests"): 0.0,
        (DECODE, "vllm:kvproto_reader_pending_reads"): 0.0,
        (DECODE, "vllm:kvproto_reader_sessions"): float(len(PREFILLS)),  # a rank each
    }
    got = {e.name: e.metrics for e in last.engines}
    for (engine, name), limit in limits.items():
        metrics = got.get(engine)
        value = None if metrics is None else metrics.get(name, 0.0)
        if value is None or value > limit:
            yield Violation(
                check="end state",
                t=last.t1,
                detail=f"{engine} {name} = {value} at the end (at most {limit:g})",
            )


TABLES = (
    "vllm:kvproto_holder_leases_held",
    "vllm:kvproto_holder_leases_granted",
    "vllm:kvproto_holder_sessions",
    "vllm:kvproto_holder_tombstones",
    "vllm:kvproto_reader_requests",
    "vllm:kvproto_reader_sessions",
    "vllm:kvproto_reader_pending_reads",
)
"""The cores' table sizes whose slopes the report prints."""


def _steady(history: History) -> dict[tuple[str, int], tuple[float, float]]:
    """(engine, incarnation) -> the stretch its memory and tables are fitted over: the second
    half of the time it served load (from its first answer to its last sample or the load's
    end), and never its first :data:`STEADY_AFTER_S`."""
    served: dict[tuple[str, int], list[float]] = {}
    for s in history.samples:
        if s.t0 > history.load_end:
            break
        for e in s.engines:
            if e.metrics is not None:
                span = served.setdefault((e.name, e.incarnation), [s.t0, s.t0])
                span[1] = s.t0
    return {
        key: (max(a + (b - a) / 2, a + STEADY_AFTER_S, history.warmup_s), b)
        for key, (a, b) in served.items()
    }


def check_growth(history: History, verdict: Verdict) -> Iterator[Violation]:
    """Memory flat once the load is steady; the tables' slopes fitted for the report."""
    rss: dict[tuple[str, int], list[tuple[float, float]]] = {}
    parts: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    tables: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    steady = _steady(history)
    for s in history.samples:
        for e in s.engines:
            a, b = steady.get((e.name, e.incarnation), (0.0, -1.0))
            if not a <= s.t0 <= b:
                continue
            if e.rss_bytes is not None:
                rss.setdefault((e.name, e.incarnation), []).append((s.t0, float(e.rss_bytes)))
            for part, size in (e.rss_parts or {}).items():
                parts.setdefault((e.name, e.incarnation, part), []).append((s.t0, float(size)))
            for table in TABLES:
                if e.metrics is not None and table in e.metrics:
                    tables.setdefault((table, e.name, e.incarnation), []).append(
                        (s.t0, e.metrics[table])
                    )
    for (name, inc), points in rss.items():
        fit = slope(points)
        if fit is None:
            continue
        verdict.slopes[f"rss {name}#{inc}"] = fit
        if fit.span_s >= JUDGED_SPAN_S and fit.low > RSS_GROWTH_LIMIT * fit.mean:
            yield Violation(
                check="growth",
                t=points[-1][0],
                detail=f"{name}#{inc} memory grows {fit.per_min / 2**20:.2f} "
                f"± {fit.half_width / 2**20:.2f} MiB/min (of {fit.mean / 2**20:.0f} MiB)",
            )
    for (name, inc, part), points in parts.items():
        fit = slope(points)
        if fit is not None and f"rss {name}#{inc}" in verdict.slopes:
            verdict.slopes[f"rss {name}#{inc} {part}"] = fit  # where it grows, not judged
    for (table, name, inc), points in tables.items():
        fit = slope(points)
        if fit is not None:
            verdict.slopes[f"{table.removeprefix('vllm:kvproto_')} {name}#{inc}"] = fit
