"""The report of a chaos run: the figures in text, and one plot over time.

The text says what ran, every figure the checker computed (answers, wrong
ones, faults by kind, each fault's reclaim against its bound, leases by how
they ended, slopes with their intervals), the simulator's comparison, and the
verdict. The plot has three panels over the run's time with the faults shaded
across all of them: the load (requests in flight, errors and hang-ups), the
leases the prefill engines keep (held, unclaimed, and those nobody explains),
and each engine's memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvproto_tools.chaos.answers import TOLERANCE
from kvproto_tools.chaos.checker import Reclaim, Verdict, orphan_bound
from kvproto_tools.chaos.history import History
from kvproto_tools.chaos.schedule import FAULT_KINDS, PREFILLS
from kvproto_tools.chaos.series import GRANTED, HELD, Explained, unexplained
from kvproto_tools.chaos.trends import Slope

MIB = 2**20
FAULT_COLOURS = {
    "kill-decode": "tab:red",
    "kill-prefill": "tab:orange",
    "partition": "tab:purple",
    "loss": "tab:olive",
    "flap": "tab:cyan",
}


def _slope_line(name: str, fit: Slope, unit: str, scale: float) -> str:
    return (
        f"  {name:<34} {fit.per_min / scale:+9.3f} ± {fit.half_width / scale:7.3f} {unit}/min "
        f"(mean {fit.mean / scale:,.1f} {unit}, {fit.span_s / 60:.1f} min, {fit.blocks} blocks)"
    )


def _worst(reclaims: Sequence[Reclaim]) -> list[str]:
    """The fault closest to its bound, for the settle time and for each kind's free time."""
    if not reclaims:
        return []
    worst = max(reclaims, key=lambda r: r.settle_s / r.settle_bound_s)
    out = [
        f"  worst settle against its bound: {worst.settle_s:.2f} s of "
        f"{worst.settle_bound_s:.2f} s (fault {worst.fault}, {worst.kind})"
    ]
    for kind in ("kill-decode", "partition"):
        freed = [
            (r.freed_s, r.freed_bound_s, r.fault)
            for r in reclaims
            if r.kind == kind and r.freed_s is not None and r.freed_bound_s is not None
        ]
        if freed:
            took, bound, fault = max(freed, key=lambda f: f[0] / f[1])
            out.append(f"  worst freed after {kind}: {took:.2f} s of {bound:.2f} s (fault {fault})")
    return out


def text(history: History, verdict: Verdict, comparison: Sequence[str] = ()) -> str:
    """The report as lines of text."""
    plan = history.plan
    lease = plan.lease_s
    out = [
        f"kvproto chaos: seed {plan.seed}, {plan.duration_s / 60:g} min of load "
        f"(schedule {verdict.digest}), kv_lease_duration {lease} s "
        f"(i {lease // 6} s, e {lease * 2 // 3} s)"
        + ("" if plan.fault_kinds == FAULT_KINDS else f"; faults: {', '.join(plan.fault_kinds)}"),
        f"deployment: {history.layout}; vllm-router; hosts in network namespaces, KV over "
        "NIXL (UCX TCP) on a fabric network of its own; started in "
        + ", ".join(f"{k} {v:.0f} s" for k, v in history.startup_s.items()),
    ]
    a = verdict.answers
    sent = sum(a.get(k, 0) for k in ("ok", "error", "cancelled"))
    out.append(
        f"requests: {sent} sent ({history.rate:g}/s steady plus bursts): {a.get('ok', 0)} "
        f"answered, wrong {a.get('wrong', 0)}; {a.get('error', 0)} errors; "
        f"{a.get('cancelled', 0)} hung up by their clients"
    )
    out.append(
        f"  answers = the plain engine's, token for token, but {a.get('drawn', 0)} choice(s) "
        "where a sampled (or near-tied greedy) token was drawn differently from the same "
        "next-token distribution; the largest log-probability difference over the right "
        f"answers' tokens: {verdict.logprob_delta:.2g} (tolerance {TOLERANCE:g})"
    )
    for kind, outcomes in sorted(verdict.by_kind.items()):
        out.append(f"  {kind:<14} " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    faults = ", ".join(f"{k} {v}" for k, v in verdict.faults.items()) or "none"
    out.append(f"faults injected: {len(history.injected)} ({faults})")
    out.append(
        "  lasted: applied to healed (a kill: to the restarted engine serving); settle: from "
        "the fault's end to the last sample with a lease that no live request explains; "
        "held: leases claimed on the P(s) it cut off as it began; freed: kill of D to those "
        "gone (PEER_LOST), or a partition past the lease to the cut-off P's gone (expiry)"
    )
    out.append(
        "    #     at kind         target                  lasted   settle   bound   held"
        "   freed   bound"
    )
    lasted = {d.fault.index: d.end - d.start for d in history.injected}
    starts = {d.fault.index: d.start for d in history.injected}
    for r in verdict.reclaims:
        freed = "" if r.freed_s is None else f"{r.freed_s:6.2f}s"
        freed_bound = "" if r.freed_bound_s is None else f"{r.freed_bound_s:6.2f}s"
        held = f"{r.held_at_start:4.0f}" if r.kind in ("kill-decode", "partition") else ""
        out.append(
            f"  {r.fault:>3} {starts[r.fault]:6.0f}s {r.kind:<12} {' <-> '.join(r.target):<20}"
            f" {lasted[r.fault]:7.1f}s {r.settle_s:7.2f}s {r.settle_bound_s:6.2f}s {held:>6}"
            f" {freed:>7} {freed_bound:>7}"
        )
    out += _worst(verdict.reclaims)
    out.append(
        "leases by end (every prefill incarnation): "
        + ", ".join(f"{k} {v}" for k, v in verdict.ended.items())
    )
    rss = {k: v for k, v in verdict.slopes.items() if k.startswith("rss ")}
    if rss:
        out.append("memory (process tree RSS, steady load, slope ± 95 % interval):")
        out += [_slope_line(k.removeprefix("rss "), v, "MiB", MIB) for k, v in rss.items()]
    tables = {k: v for k, v in verdict.slopes.items() if not k.startswith("rss ") and v.mean > 0}
    if tables:
        out.append("tables (entries, steady load, slope ± 95 % interval; empty tables left out):")
        out += [_slope_line(k, v, "", 1.0) for k, v in tables.items()]
    if comparison:
        out.append("simulator, the same schedule:")
        out += ["  " + line for line in comparison]
    if verdict.clean:
        out.append("checker: clean, no violation")
    else:
        out.append(f"checker: {len(verdict.violations)} violation(s):")
        out += [
            f"  [{v.check}]" + (f" at {v.t:.2f} s" if v.t is not None else "") + f": {v.detail}"
            for v in verdict.violations
        ]
    return "\n".join(out) + "\n"


def plot(history: History, verdict: Verdict, path: Path) -> None:
    """The run over time in one figure (.png, .svg or .pdf by the suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (load, leases, memory) = plt.subplots(
        3, 1, figsize=(13, 8.5), sharex=True, height_ratios=(1.0, 1.3, 0.8)
    )
    samples = history.samples
    ts = [s.t0 for s in samples]
    lease_s = history.plan.lease_s
    explained = Explained(history, orphan_s=0.0)
    load.plot(ts, [explained.at(s) for s in samples], color="tab:blue", lw=0.8, label="in flight")
    for outcome, colour, marker in (("error", "tab:red", "x"), ("cancelled", "tab:gray", "|")):
        ends = [s.ended for s in history.sent if s.outcome == outcome]
        load.plot(
            ends, [0] * len(ends), marker, color=colour, ms=6, label=f"{outcome} ({len(ends)})"
        )
    load.set_ylabel("requests")
    load.legend(loc="upper left", fontsize=8, ncols=3, frameon=False)
    for name, style in zip(PREFILLS, ("-", "--"), strict=True):
        for gauge, colour, label in (
            (HELD, "tab:green", "held"),
            (GRANTED, "tab:brown", "unclaimed"),
        ):
            leases.plot(
                ts,
                [
                    next(
                        (
                            e.metrics.get(gauge, 0.0)
                            for e in s.engines
                            if e.name == name and e.metrics
                        ),
                        float("nan"),
                    )
                    for s in samples
                ],
                style,
                color=colour,
                lw=0.9,
                label=f"{name} {label}",
            )
    stranded = [n for _, n in unexplained(history, orphan_bound(history))]
    leases.fill_between(
        ts,
        stranded,
        step="post",
        color="tab:red",
        alpha=0.5,
        lw=0,
        label="no request explains",
    )
    leases.set_ylabel("leases on P")
    leases.legend(loc="upper left", fontsize=8, ncols=4, frameon=False)
    for name in ("prefill-0", "prefill-1", "decode-0"):
        points = [
            (s.t0, e.rss_bytes / MIB)
            for s in samples
            for e in s.engines
            if e.name == name and e.rss_bytes is not None
        ]
        if points:
            memory.plot(*zip(*points, strict=True), lw=0.9, label=name)
    memory.set_ylabel("RSS (MiB)")
    memory.set_xlabel("seconds into the run")
    memory.legend(loc="lower right", fontsize=8, ncols=3, frameon=False)
    for done in history.injected:
        colour = FAULT_COLOURS.get(done.fault.kind, "tab:gray")
        for ax in (load, leases, memory):
            ax.axvspan(done.start, max(done.end, done.start + 0.5), color=colour, alpha=0.18, lw=0)
        leases.annotate(
            done.fault.kind,
            (done.start, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            fontsize=7,
            color=colour,
        )
    verdict_line = "clean" if verdict.clean else f"{len(verdict.violations)} violation(s)"
    fig.suptitle(
        f"kvproto chaos, seed {history.plan.seed}: {verdict.answers.get('ok', 0)} answers, "
        f"wrong {verdict.answers.get('wrong', 0)}, {len(history.injected)} faults "
        f"(shaded), lease {lease_s} s; checker {verdict_line}",
        fontsize=11,
    )
    for ax in (load, leases, memory):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
