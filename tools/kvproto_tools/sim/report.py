"""Presenting runs: the comparison table, one conclusion per scenario, JSON, the plot."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvproto_tools.sim.console import Out, render_table
from kvproto_tools.sim.engine import RunResult
from kvproto_tools.sim.model import METRIC_KEYS
from kvproto_tools.sim.policies import POLICIES
from kvproto_tools.sim.scenarios import SCENARIOS

LABELS: dict[str, tuple[str, str]] = {
    "reclaim_s": (
        "reclaim s",
        "seconds from a decode crash (or a router's drop) until the blocks nobody will read "
        "were freed",
    ),
    "dead_block_seconds": (
        "dead blk·s",
        "KV blocks x seconds held although no live reader would use them",
    ),
    "premature_frees": (
        "premature",
        "block sets freed while a live reader still waited to read them",
    ),
    "overlapped_reads": (
        "used freed",
        "reads whose data was used although the blocks were freed before the read ended "
        "(silent corruption)",
    ),
    "wasted_prefill_tokens": (
        "recomp tok",
        "prompt tokens recomputed because prefilled blocks could not be used",
    ),
    "heartbeat_bytes": ("HB bytes", "bytes of heartbeat traffic (kvproto: heartbeats + acks)"),
    "heartbeat_messages": ("HB msgs", "heartbeat messages (kvproto: heartbeats + acks)"),
    "safety_violations": (
        "unsafe",
        "safety oracle failures (use of freed blocks, shortened deadline, double free, ...)",
    ),
    "written_freed": (
        "wrote freed",
        "push mode: WRITEs whose data landed in decoder blocks no longer waiting for them "
        "(silent corruption of whoever has them)",
    ),
}
SUMMED = frozenset({"premature_frees", "overlapped_reads", "safety_violations", "written_freed"})
"""Counts: summed over seeds. Every other figure is averaged per run."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One (scenario, policy) aggregated over its seeds."""

    scenario: str
    """Scenario name."""
    policy: str
    """Policy name."""
    runs: int
    """Number of seeds."""
    values: dict[str, float | None]
    """Per metric: sum (counts) or mean (everything else); None if never defined."""
    reclaim_max: float | None
    """Worst reclaim over the seeds."""
    liveness: int
    """Liveness violations, summed."""
    counters: dict[str, float]
    """The policy's own counters (``RunResult.extra["vllm_num_*"]``), summed over seeds."""


class Tally:
    """The table's figures, summed up run by run, so a sweep need not keep its runs.

    Each (scenario, policy) keeps one running sum and count per metric, in the
    order the runs are added; fed in canonical order (as ``sweep.stream`` yields
    them) the sums, and so the table, are those of summing every run at the end.
    """

    def __init__(self) -> None:
        self._groups: dict[tuple[str, str], _Group] = {}

    def add(self, r: RunResult) -> None:
        """Count one run in its (scenario, policy) group."""
        group = self._groups.get((r.scenario, r.policy))
        if group is None:
            group = self._groups[(r.scenario, r.policy)] = _Group()
        group.add(r)

    def rows(self) -> list[Row]:
        """One row per (scenario, policy), in the canonical order."""
        order = {name: i for i, name in enumerate(SCENARIOS)}
        porder = {name: i for i, name in enumerate(POLICIES)}
        keys = sorted(self._groups, key=lambda k: (order[k[0]], porder[k[1]]))
        return [self._groups[k].row(*k) for k in keys]


class _Group:
    """Running sums of one (scenario, policy)."""

    def __init__(self) -> None:
        self.runs = 0
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.reclaim_max: float | None = None
        self.liveness = 0
        self.counters: dict[str, float] = {}

    def add(self, r: RunResult) -> None:
        self.runs += 1
        for key in METRIC_KEYS:
            v = r.metrics[key]
            if v is not None:
                self.sums[key] = self.sums.get(key, 0.0) + float(v)
                self.counts[key] = self.counts.get(key, 0) + 1
        reclaim = r.metrics["reclaim_s"]
        if reclaim is not None:
            worst = self.reclaim_max
            self.reclaim_max = float(reclaim) if worst is None else max(worst, float(reclaim))
        self.liveness += r.liveness_violations
        for k, v in r.extra.items():
            if k.startswith("vllm_num_"):
                self.counters[k] = self.counters.get(k, 0) + v

    def row(self, scenario: str, policy: str) -> Row:
        values: dict[str, float | None] = {}
        for key in METRIC_KEYS:
            if key not in self.counts:
                values[key] = None
            elif key in SUMMED:
                values[key] = self.sums[key]
            else:
                values[key] = self.sums[key] / self.counts[key]
        return Row(
            scenario=scenario,
            policy=policy,
            runs=self.runs,
            values=values,
            reclaim_max=self.reclaim_max,
            liveness=self.liveness,
            counters=dict(self.counters),
        )


def aggregate(results: Iterable[RunResult]) -> list[Row]:
    """Group runs by (scenario, policy) in the canonical order."""
    tally = Tally()
    for r in results:
        tally.add(r)
    return tally.rows()


def _fmt(key: str, value: float | None) -> str:
    if value is None:
        return "-"
    if key in ("reclaim_s",):
        return f"{value:.1f}"
    if key == "dead_block_seconds":
        return f"{value:,.0f}"
    if key in SUMMED:
        return f"{value:.0f}"
    return f"{value:,.0f}"


def print_table(out: Out, rows: Sequence[Row], *, liveness: bool, seeds: int) -> None:
    """The comparison table (rich where installed, aligned text otherwise)."""
    per = "per run" if seeds == 1 else f"mean of {seeds} seeds; counts summed"
    header = ["scenario", "policy", *(LABELS[key][0] for key in METRIC_KEYS)]
    if liveness:
        header.append("liveness")
    cells_rows: list[list[str] | None] = []
    last = None
    for row in rows:
        if last is not None and row.scenario != last:
            cells_rows.append(None)
        cells = [row.scenario if row.scenario != last else "", row.policy]
        for key in METRIC_KEYS:
            text = _fmt(key, row.values[key])
            if key == "reclaim_s" and seeds > 1 and row.reclaim_max is not None:
                text += f" (max {row.reclaim_max:.0f})"
            bad = key in ("overlapped_reads", "safety_violations") and (row.values[key] or 0) > 0
            cells.append(f"[red]{text}[/red]" if bad else text)
        if liveness:
            cells.append(f"[red]{row.liveness}[/red]" if row.liveness else "0")
        cells_rows.append(cells)
        last = row.scenario
    render_table(
        out,
        f"kvproto simulate - {per}",
        header,
        cells_rows,
        right=[False, False, *([True] * (len(header) - 2))],
    )


def conclusions(rows: Sequence[Row]) -> list[str]:
    """One line per scenario: its headline figure per policy, and who used freed blocks."""
    by_scenario: dict[str, list[Row]] = {}
    for row in rows:
        by_scenario.setdefault(row.scenario, []).append(row)
    out = []
    for scenario, group in by_scenario.items():
        sc = SCENARIOS[scenario]
        key = sc.headline
        label = LABELS[key][0]
        figures = ", ".join(f"{r.policy} {_fmt(key, r.values[key])}" for r in group)
        # Pull runs use freed blocks (overlapped_reads), push runs write into them.
        bad = "written_freed" if sc.push is not None else "overlapped_reads"
        unsafe = [
            f"{r.policy} ({_fmt(bad, r.values[bad])})" for r in group if (r.values[bad] or 0) > 0
        ]
        if key in ("overlapped_reads", "written_freed"):
            verdict = "silent corruption: " + (", ".join(unsafe) if unsafe else "none")
            line = f"{label}: {figures} ({verdict})."
        else:
            what = "wrote into" if sc.push is not None else "used"
            verdict = f"{what} freed blocks: " + (", ".join(unsafe) if unsafe else "nobody")
            line = f"{label}: {figures}; {verdict}."
        for note in (_fenced_premature(group), _vllm_saw_it(group)):
            if note:
                line += "\n      " + note
        out.append(f"[cyan]{scenario}[/cyan] - {sc.summary}\n      {line}")
    return out


def _vllm_saw_it(group: Sequence[Row]) -> str:
    """What vLLM 0.32's own counters said while it served freed blocks."""
    row = next((r for r in group if r.policy == "vllm-lease"), None)
    if row is None or not (row.values["overlapped_reads"] or 0) > 0:
        return ""
    late = row.counters.get("vllm_num_notifications_after_expiry", 0)
    expired = row.counters.get("vllm_num_kv_expired_reqs", 0)
    return (
        f"vllm-lease's own counters: num_kv_expired_reqs {expired:.0f}, "
        f"num_notifications_after_expiry {late:.0f} (its 'Potentially invalid KV blocks' "
        f"error, logged at P while D has already used what it read: a log line, not a fence)."
    )


def _fenced_premature(group: Sequence[Row]) -> str:
    """Why kvproto shows premature frees without using freed blocks (the design working)."""
    kv = next((r for r in group if r.policy == "kvproto"), None)
    if kv is None or not (kv.values["premature_frees"] or 0) > 0:
        return ""
    n = _fmt("premature_frees", kv.values["premature_frees"])
    tokens = _fmt("wasted_prefill_tokens", kv.values["wasted_prefill_tokens"])
    return (
        f"kvproto premature {n}: a reader (in push mode, the writer) that cannot heartbeat in "
        f"time (a stalled step, a cut link) loses its lease, as designed; its read (or write) "
        f"is then fenced and the prompt recomputed (part of recomp tok {tokens}), never served "
        f"from freed blocks."
    )


def print_report(console: Out, results: Sequence[RunResult], *, liveness: bool, seeds: int) -> None:
    """Table, legend and conclusions."""
    print_rows(console, aggregate(results), liveness=liveness, seeds=seeds)


def print_rows(console: Out, rows: Sequence[Row], *, liveness: bool, seeds: int) -> None:
    """Table, legend and conclusions of aggregated rows (:class:`Tally`)."""
    print_table(console, rows, liveness=liveness, seeds=seeds)
    console.print("[bold]Columns[/bold]")
    for key in METRIC_KEYS:
        name, meaning = LABELS[key]
        console.print(f"  [bold]{name}[/bold]: {meaning}")
    if liveness:
        console.print("  [bold]liveness[/bold]: liveness bound failures (L1-L3, spec/simulator.md)")
    console.print("[bold]Policies[/bold]")
    for name, policy in POLICIES.items():
        if any(r.policy == name for r in rows):
            console.print(f"  [bold]{name}[/bold]: {policy.summary}")
    console.print("[bold]Conclusions[/bold]")
    for line in conclusions(rows):
        console.print("  " + line)


def write_json(results: Sequence[RunResult], path: str | Path) -> None:
    """``{"runs": [...]}`` exactly as documented in spec/simulator.md."""
    doc = {"runs": [r.to_json() for r in results]}
    Path(path).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


class JsonRuns:
    """``write_json``'s document, built run by run in a temporary file instead of in memory.

    The bytes are those of ``json.dumps({"runs": [...]}, indent=2)``: each run
    is dumped alone and indented to its depth in the list. The target is
    written only by :meth:`write`, so a sweep that stops half-way leaves it as
    it was.
    """

    _INDENT = " " * 4
    """A run's depth: inside the document's object, inside the ``runs`` list."""

    def __init__(self) -> None:
        # Kept open across calls; write() or close() ends it (an unnamed file: gone at exit).
        self._spool: IO[str] = tempfile.TemporaryFile("w+", encoding="utf-8")  # noqa: SIM115
        self._count = 0

    def add(self, r: RunResult) -> None:
        """Append one run (in canonical order)."""
        entry = textwrap.indent(json.dumps(r.to_json(), indent=2), self._INDENT)
        self._spool.write((",\n" if self._count else "") + entry)
        self._count += 1

    def write(self, path: str | Path) -> None:
        """Write the whole document to ``path`` and drop the spool."""
        self._spool.seek(0)
        with open(path, "w", encoding="utf-8") as out:
            if not self._count:
                out.write('{\n  "runs": []\n}\n')
            else:
                out.write('{\n  "runs": [\n')
                shutil.copyfileobj(self._spool, out)
                out.write("\n  ]\n}\n")
        self.close()

    def close(self) -> None:
        """Drop the spool."""
        self._spool.close()


COLORS = {
    "fixed-480": "tab:red",
    "fixed-short": "tab:orange",
    "vllm-v4": "tab:purple",
    "vllm-lease": "tab:blue",
    "kvproto": "tab:green",
}
"""One colour per policy in every panel."""


COINCIDE = 0.01
"""Two curves coincide when they differ by at most this fraction of the panel's peak, on
average over the run (steps a few milliseconds apart are invisible at plot scale)."""


def _sample(timeline: Sequence[tuple[float, int]], grid: Sequence[float]) -> list[int]:
    """The step function ``timeline`` at each time of ``grid`` (both ascending)."""
    out, i, value = [], 0, 0
    for t in grid:
        while i < len(timeline) and timeline[i][0] <= t:
            value = timeline[i][1]
            i += 1
        out.append(value)
    return out


def curve_groups(first: dict[tuple[str, str], RunResult], scenario: str) -> list[list[str]]:
    """The scenario's policies grouped by coinciding held-blocks curves, in policy order.

    Coinciding curves would hide each other; the plot draws one line per group and
    names every policy in it ("fixed-480 ≈ vllm-lease ≈ kvproto").
    """
    runs = {p: first[(scenario, p)] for p in POLICIES if (scenario, p) in first}
    end = max((r.timeline[-1][0] for r in runs.values()), default=0.0)
    grid = [end * k / 999 for k in range(1000)]
    curves = {p: _sample(r.timeline, grid) for p, r in runs.items()}
    peak = max((max(c) for c in curves.values()), default=0) or 1
    groups: list[list[str]] = []
    for policy, curve in curves.items():
        for group in groups:
            ref = curves[group[0]]
            diff = sum(abs(a - b) for a, b in zip(curve, ref, strict=True)) / len(grid)
            if diff <= COINCIDE * peak:
                group.append(policy)
                break
        else:
            groups.append([policy])
    return groups


def fault_time(scenario: str) -> tuple[float, str] | None:
    """When the scenario's fault strikes and what it is, for the plot; None without one."""
    sc = SCENARIOS[scenario]
    if sc.decode_crash is not None:
        return sc.decode_crash[1], f"{sc.decode_crash[0]} crash"
    if sc.prefill_restart is not None:
        return sc.prefill_restart[1], f"{sc.prefill_restart[0]} restart"
    if sc.partition is not None:
        return sc.partition[2], "partition"
    return None


DASH = 6.0
"""Length (points) of one policy's stripe on a line that several policies share."""


def _draw_group(ax: Any, run: RunResult, members: Sequence[str], width: float) -> tuple[Any, ...]:
    """One curve for every policy in ``members``, striped in each one's colour.

    Drawn in one colour, a shared line would take one member's colour and lose
    the others', and a policy's colour would change from panel to panel. Each
    member draws the same steps in its own colour, dashed and offset so the
    stripes take turns: every policy keeps its colour in every panel.
    """
    xs = [t for t, _ in run.timeline]
    ys = [n for _, n in run.timeline]
    lines = []
    for k, policy in enumerate(members):
        style: Any = "-" if len(members) == 1 else (k * DASH, (DASH, DASH * (len(members) - 1)))
        (line,) = ax.step(
            xs,
            ys,
            where="post",
            color=COLORS.get(policy),
            linestyle=style,
            linewidth=width,
            alpha=0.9,
        )
        lines.append(line)
    return tuple(lines)


def _mark_fault(ax: Any, scenario: str, reclaims: dict[str, float]) -> str:
    """A vertical line at the fault and a tick at each policy's reclaim; returns the times.

    Reclaim times differ by seconds on a plot of minutes (kvproto's 1 s against
    29 s after a reported crash): the curves alone would not show them, so each
    policy's reclaim is a tick in its colour at the foot of the panel, and the
    returned line (for the panel's title) writes them out.
    """
    fault = fault_time(scenario)
    if fault is None:
        return ""
    at, what = fault
    ax.axvline(at, color="0.35", linestyle=":", linewidth=1.2)
    ax.annotate(
        f"{what} at {at:.0f} s",
        xy=(at, 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(-3, -4),
        textcoords="offset points",
        rotation=90,
        ha="right",
        va="top",
        fontsize=7,
        color="0.35",
    )
    for policy, reclaim in reclaims.items():
        ax.plot(
            [at + reclaim],
            [0.0],
            marker="^",
            markersize=7,
            color=COLORS.get(policy),
            transform=ax.get_xaxis_transform(),
            clip_on=False,
            linestyle="none",
        )
    if not reclaims:
        return ""
    return "reclaim (s): " + ", ".join(f"{p} {r:.1f}" for p, r in reclaims.items())


def plot(results: Sequence[RunResult], path: str | Path) -> None:
    """Held blocks over time, one panel per scenario, one line per distinct curve (first seed).

    The format follows the suffix (``outpaths.PLOT_SUFFIXES``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.legend_handler import HandlerTuple

    first: dict[tuple[str, str], RunResult] = {}
    for r in results:
        if r.timeline and (r.scenario, r.policy) not in first:
            first[(r.scenario, r.policy)] = r
    scenarios = [s for s in SCENARIOS if any(k[0] == s for k in first)]
    if not scenarios:
        raise ValueError("no run recorded a timeline")
    ncols = min(3, len(scenarios))
    nrows = math.ceil(len(scenarios) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows), squeeze=False)
    for i, scenario in enumerate(scenarios):
        ax = axes[i // ncols][i % ncols]
        handles, labels = [], []
        # Widest first, so a line drawn later never covers one drawn before it entirely.
        for g, members in enumerate(curve_groups(first, scenario)):
            run = first[(scenario, members[0])]
            handles.append(_draw_group(ax, run, members, 2.6 - 0.5 * min(g, 3)))
            labels.append(" ≈ ".join(members))
        reclaims = {
            p: float(v)
            for p in POLICIES
            if (scenario, p) in first
            and (v := first[(scenario, p)].metrics["reclaim_s"]) is not None
        }
        reclaim = _mark_fault(ax, scenario, reclaims)
        title = f"{scenario} (seed {first_seed(first, scenario)})"
        ax.set_title(title + (f"\n{reclaim}" if reclaim else ""), fontsize=9 if reclaim else 10)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("KV blocks held")
        ax.grid(alpha=0.3)
        ax.legend(
            handles,
            labels,
            handler_map={tuple: HandlerTuple(ndivide=1)},  # stripes overlaid, as on the line
            fontsize=7,
            loc="upper right",
            frameon=False,
        )
    for j in range(len(scenarios), nrows * ncols):
        axes[j // ncols][j % ncols].axis("off")
    fig.suptitle(
        "KV blocks held over time (first seed); a ≈ b: the two policies' curves "
        f"coincide (within {COINCIDE:.0%} of the peak) and share one line, striped in "
        "both colours; dotted: the fault; ▲: each policy's reclaim",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def first_seed(first: dict[tuple[str, str], RunResult], scenario: str) -> int:
    """The seed plotted for ``scenario``."""
    return min(r.seed for (s, _), r in first.items() if s == scenario)
