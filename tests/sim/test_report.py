"""What the report tells a reader: coinciding curves named, kvproto's premature frees explained."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvproto_tools.sim import RunResult
from kvproto_tools.sim.report import aggregate, conclusions, curve_groups, plot
from kvproto_tools.sim.sweep import Task, run_task
from tests.sim.runs import result


def _first(scenario: str, policies: tuple[str, ...]) -> dict[tuple[str, str], RunResult]:
    return {
        (scenario, p): run_task(Task(scenario=scenario, policy=p, seed=0, timeline=True))
        for p in policies
    }


def test_coinciding_curves_share_one_labelled_line(tmp_path: Path) -> None:
    normal = _first("normal", ("fixed-480", "vllm-lease", "kvproto"))
    # In a healthy cluster every lease policy frees on the read's notification: one curve.
    assert curve_groups(normal, "normal") == [["fixed-480", "vllm-lease", "kvproto"]]
    crash = _first("decode-crash", ("fixed-480", "kvproto"))
    # The 480 s timeout holds the dead decoder's blocks long after kvproto freed them.
    assert curve_groups(crash, "decode-crash") == [["fixed-480"], ["kvproto"]]
    runs = [*normal.values(), *crash.values()]
    for name in ("held.png", "held.svg"):
        plot(runs, tmp_path / name)
    assert (tmp_path / "held.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in (tmp_path / "held.svg").read_bytes()[:400]


def test_kvproto_premature_frees_are_explained() -> None:
    rows = aggregate([result("partition", "kvproto"), result("normal", "kvproto")])
    cut = next(r for r in rows if r.scenario == "partition")
    assert cut.values["premature_frees"]  # a cut-off reader lost its lease ...
    assert cut.values["overlapped_reads"] == 0  # ... and did not use freed blocks
    normal, partition = conclusions(rows)
    assert "kvproto premature" in partition and "as designed" in partition
    assert "fenced" in partition and "recomputed" in partition
    assert "kvproto premature" not in normal


def test_vllms_own_counters_are_reported_where_it_served_freed_blocks() -> None:
    runs = [result("slow-forward", "vllm-lease"), result("normal", "vllm-lease")]
    late = runs[0].extra["vllm_num_notifications_after_expiry"]
    assert runs[0].metrics["overlapped_reads"] and late > 0  # vLLM 0.32 noticed, too late
    normal, slow = conclusions(aggregate(runs))
    assert f"num_notifications_after_expiry {late:.0f}" in slow and "not a fence" in slow
    assert "num_notifications_after_expiry" not in normal


def test_plot_keeps_each_policys_colour_and_marks_the_fault_and_reclaims(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared line is striped in every member's colour; the crash is a vertical line and
    every policy's reclaim time is in the panel's title (kvproto's 1 s beside 29 s)."""
    import matplotlib.figure
    from matplotlib.colors import to_hex

    from kvproto_tools.sim.report import COLORS

    saved: list[matplotlib.figure.Figure] = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    runs = [
        run_task(Task(scenario="decode-crash-reported", policy=p, seed=0, timeline=True))
        for p in ("fixed-short", "vllm-lease", "kvproto")
    ]
    plot(runs, tmp_path / "held.png")
    ax = saved[0].axes[0]
    colours = {to_hex(line.get_color()) for line in ax.get_lines()}
    assert {to_hex(COLORS[p]) for p in ("fixed-short", "vllm-lease", "kvproto")} <= colours
    fault = [line for line in ax.get_lines() if list(line.get_xdata()) == [60.0, 60.0]]
    assert fault, "no vertical line at the crash"
    title = ax.get_title()
    assert "kvproto 1.0" in title and "vllm-lease 29.2" in title
