"""Rich tables: every figure beside its anchor and the ratio, and the scaling curve."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvproto_tools.bench import scaling
from kvproto_tools.bench.figures import Figure


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    ax = abs(x)
    if ax >= 100:
        return f"{x:,.0f}"
    if ax >= 1:
        return f"{x:.2f}"
    if ax >= 0.01:
        return f"{x:.3f}"
    return f"{x:.2e}"


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for div, suffix in ((1_000_000, "M"), (1_000, "k")):
        if n >= div and n % div == 0:
            return f"{n // div}{suffix}"
    return str(n)


def figures_table(figures: list[Figure], title: str) -> Table:
    """One row per figure. Ratio = anchor / kvproto: > 1 means kvproto is cheaper."""
    table = Table(title=title, show_lines=False, header_style="bold")
    table.add_column("figure", no_wrap=True)
    table.add_column("size", justify="right")
    table.add_column("kvproto", justify="right")
    table.add_column("unit")
    table.add_column("anchor")
    table.add_column("anchor value", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("target")
    for f in figures:
        ratio = f.ratio
        verdict = ""
        if f.target:
            mark = {True: "[green]met[/]", False: "[red]MISSED[/]", None: ""}[f.met]
            verdict = f"{f.target} {mark}".strip()
        table.add_row(
            f.name,
            _size(f.size),
            _num(f.value),
            f.unit,
            f.anchor or "-",
            _num(f.anchor_value),
            "-" if ratio is None else f"{_num(ratio)}x",
            verdict,
        )
    return table


def scaling_table(figures: list[Figure]) -> Table:
    """kvproto and vLLM side by side per size, for both curves."""
    table = Table(title="Scaling (median microseconds)", header_style="bold")
    table.add_column("live leases", justify="right")
    idle = {p[0]: p for p in scaling.points(figures, "holder.idle_step")}
    apply = {p[0]: p for p in scaling.points(figures, "holder.heartbeat_apply")}
    for head in ("kvproto idle", "vLLM idle", "kvproto apply", "vLLM apply"):
        table.add_column(head, justify="right")
    for size in sorted(set(idle) | set(apply)):
        i = idle.get(size)
        a = apply.get(size)
        table.add_row(
            _size(size),
            _num(i[1]) if i else "-",
            _num(i[2]) if i else "-",
            _num(a[1]) if a else "-",
            _num(a[2]) if a else "-",
        )
    return table


def print_report(console: Console, figures: list[Figure]) -> None:
    """The main table, then the scaling view where the run has scaling points."""
    console.print(
        figures_table(figures, "kvproto bench (ratio = anchor / kvproto; > 1: kvproto cheaper)")
    )
    if any(scaling.points(figures, name) for name in scaling.CURVES):
        console.print(scaling_table(figures))
