"""The scaling curve: holder idle step and heartbeat apply against live leases, 10^3 .. 10^6.

The points are the holder figures themselves (one measurement, two views).
Growth order is the least-squares slope of log(cost) on log(leases): about
0 for O(1), about 1 for O(n). A PNG (matplotlib, Agg) shows both sides on
log-log axes with O(1) and O(n) guides.
"""

from __future__ import annotations

import math
from pathlib import Path

from kvproto_tools.bench.figures import Figure

CURVES = ("holder.idle_step", "holder.heartbeat_apply")
FLOORS = {
    "holder.idle_step": "holder.idle_step.vs_bare_scan",
    "holder.heartbeat_apply": "holder.heartbeat_apply.vs_bare_parse",
}


SAME_OPERATION = {
    "holder.idle_step": ("holder.idle_step.vs_bare_scan", "holder.idle_step.vs_head_stop"),
    "holder.heartbeat_apply": ("holder.heartbeat_apply.vs_bare_parse",),
}
"""Figures whose kvproto side times the same operation again (paired with another anchor)."""


def points(figures: list[Figure], name: str) -> list[tuple[int, float, float]]:
    """(size, kvproto, anchor) for one curve, ascending size.

    The kvproto operation is timed once per anchor it is paired with; the
    curve takes the least disturbed of those medians (the smallest), since
    on a shared machine noise only ever adds time.
    """
    same = {name, *SAME_OPERATION.get(name, ())}
    ours: dict[int, float] = {}
    for f in figures:
        if f.name in same and f.size is not None:
            ours[f.size] = min(ours.get(f.size, f.value), f.value)
    out = [
        (f.size, ours[f.size], f.anchor_value)
        for f in figures
        if f.name == name and f.size is not None and f.anchor_value is not None
    ]
    return sorted(out)


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) on log(x)."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1e-12)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((x - mx) ** 2 for x in lx)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly, strict=True)) / den if den else 0.0


def growth_figures(figures: list[Figure]) -> list[Figure]:
    """One exponent figure per curve (needs two sizes or more)."""
    out = []
    for name in CURVES:
        pts = points(figures, name)
        if len(pts) < 2:
            continue
        xs = [float(p[0]) for p in pts]
        out.append(
            Figure(
                name=f"scaling.{name.split('.', 1)[1]}.exponent",
                size=pts[-1][0],
                value=slope(xs, [p[1] for p in pts]),
                unit="exponent",
                anchor="vllm-lease (same curve)",
                anchor_value=slope(xs, [p[2] for p in pts]),
                target="~0 (O(1))",
                met=slope(xs, [p[1] for p in pts]) < 0.25,
                comparable=False,
            )
        )
    return out


def plot(figures: list[Figure], path: Path) -> None:
    """Log-log PNG of both curves, kvproto beside vLLM v4."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(11, 4.2))
    titles = {
        "holder.idle_step": "Holder idle step (nothing expires)",
        "holder.heartbeat_apply": "Decode + apply one heartbeat batch",
    }
    for ax, name in zip(axes, CURVES, strict=True):
        pts = points(figures, name)
        if not pts:
            ax.set_visible(False)
            continue
        xs = [p[0] for p in pts]
        ours = [p[1] for p in pts]
        theirs = [p[2] for p in pts]
        ax.loglog(xs, theirs, "o-", color="tab:red", label="vLLM lease v4 (restated)")
        floor = points(figures, FLOORS[name])
        if floor:
            ax.loglog(
                [p[0] for p in floor],
                [p[2] for p in floor],
                "^--",
                color="tab:gray",
                label="bare dict pass / parse (floor)",
            )
        ax.loglog(xs, ours, "s-", color="tab:blue", label="kvproto")
        # Guides through the first point of each side: flat = O(1), unit slope = O(n).
        ax.loglog(xs, [ours[0]] * len(xs), ":", color="tab:blue", alpha=0.5, label="O(1) guide")
        ax.loglog(
            xs,
            [theirs[0] * x / xs[0] for x in xs],
            ":",
            color="tab:red",
            alpha=0.5,
            label="O(n) guide",
        )
        ax.set_title(titles[name])
        ax.set_xlabel("live leases")
        ax.set_ylabel("microseconds (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("kvproto vs vLLM lease v4, measured in one process")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
