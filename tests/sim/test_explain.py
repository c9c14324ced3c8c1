"""``kvproto simulate --explain``: the figure definitions a wheel install can read."""

from __future__ import annotations

import re

from kvproto_tools.sim.explain import FIGURES
from kvproto_tools.sim.model import METRIC_KEYS
from tests.sim.test_cli_errors import ROOT, kvproto


def _table_columns(stdout: str) -> list[str]:
    """The figure columns of a plain-text ``kvproto simulate`` table (after scenario, policy)."""
    lines = stdout.splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("kvproto simulate - "))
    header = re.split(r"\s{2,}", lines[title + 1].strip())
    assert header[:2] == ["scenario", "policy"], header
    return header[2:]


def test_explain_defines_every_column_the_table_prints() -> None:
    run = kvproto(
        "simulate", "--scenario", "normal", "--policy", "kvproto", "--liveness", hide="rich"
    )
    assert run.returncode == 0, run.stderr
    columns = _table_columns(run.stdout)
    assert len(columns) == len(METRIC_KEYS) + 1  # the figures and liveness
    explained = kvproto("simulate", "--explain", hide="rich")
    assert (explained.returncode, explained.stderr) == (0, ""), explained.stderr
    lines = explained.stdout.splitlines()
    for column in columns:
        defined = [line for line in lines if line.strip().startswith(f"{column} (") or
                   line.strip().startswith(f"{column}:")]  # fmt: skip
        assert defined, f"{column!r} is not explained"
        assert len(defined[0]) > len(column) + 40  # a definition, not just the name
    assert "Simulating" not in explained.stdout  # nothing ran


def test_explain_covers_the_manuals_figure_list() -> None:
    """The shipped definitions and spec/simulator.md's "Figures" table name the same keys."""
    spec = (ROOT / "spec" / "simulator.md").read_text(encoding="utf-8")
    section = spec.split("## Figures", 1)[1].split("\n## ", 1)[0]
    keys = [
        key
        for row in section.splitlines()
        if row.startswith("| `")
        for key in re.findall(r"`(\w+)`", row.split("|")[1])
    ]
    assert keys == list(METRIC_KEYS) == list(FIGURES)


def test_the_closing_line_points_to_explain_not_to_a_file_the_wheel_lacks() -> None:
    run = kvproto("simulate", "--scenario", "normal", "--policy", "kvproto")
    assert run.returncode == 0, run.stderr
    last = run.stdout.strip().splitlines()[-1]
    assert "kvproto simulate --explain" in last
    assert "spec/" not in last
