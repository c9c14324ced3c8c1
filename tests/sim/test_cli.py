"""``kvproto simulate`` output: the table, the JSON shape, the plot, exit codes, delegation."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvproto_tools import cli
from kvproto_tools.sim import METRIC_KEYS, POLICIES, SCENARIOS
from kvproto_tools.sim.policies import DEFAULT_POLICIES
from kvproto_tools.sim.scenarios import DEFAULT_SET
from tests.sim.test_oracles import _DoubleFreeSide, _policy

ROOT = Path(__file__).resolve().parents[2]


def test_json_has_exactly_the_documented_shape(tmp_path: Path) -> None:
    out = tmp_path / "runs.json"
    code = cli.main(
        [
            "simulate",
            "--scenario",
            "normal",
            "--policy",
            "all",
            "--seeds",
            "2",
            "--jobs",
            "1",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    doc = json.loads(out.read_text())
    assert list(doc) == ["runs"]
    assert len(doc["runs"]) == len(POLICIES) * 2
    for run in doc["runs"]:
        assert list(run) == ["scenario", "policy", "seed", "metrics"]
        assert run["scenario"] == "normal" and run["policy"] in POLICIES
        assert list(run["metrics"]) == list(METRIC_KEYS)
        m = run["metrics"]
        assert m["reclaim_s"] is None  # no crash in this scenario
        assert isinstance(m["dead_block_seconds"], float)
        for key in METRIC_KEYS[2:]:
            assert isinstance(m[key], int)
    assert [(r["policy"], r["seed"]) for r in doc["runs"][:2]] == [
        ("fixed-480", 0),
        ("fixed-480", 1),
    ]


def test_table_plot_and_conclusions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "held.png"
    code = cli.main(
        [
            "simulate",
            "--scenario",
            "decode-crash",
            "--policy",
            "fixed-480,kvproto",
            "--jobs",
            "1",
            "--plot",
            str(png),
        ]
    )
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "reclaim s" in text and "Conclusions" in text
    assert "decode-crash" in text and "fixed-480 47" in text  # ~477 s after the crash


def test_kvproto_violation_fails_the_command_and_prints_the_replay(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = dataclasses.replace(_policy(side=_DoubleFreeSide), name="kvproto")
    monkeypatch.setitem(POLICIES, "kvproto", broken)
    code = cli.main(
        [
            "simulate",
            "--scenario",
            "decode-overload",
            "--policy",
            "kvproto",
            "--seed",
            "0",
            "--jobs",
            "1",
        ]
    )
    text = capsys.readouterr().out
    assert code == 1
    assert "S4 double free" in text
    assert "replay: kvproto simulate --scenario decode-overload --policy kvproto --seed 0" in text
    assert "last events before it" in text


def test_baseline_failures_do_not_fail_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(
        ["simulate", "--scenario", "decode-overload", "--policy", "fixed-short", "--jobs", "1"]
    )
    assert code == 0
    assert "S1 use after free" in capsys.readouterr().out


def test_default_is_every_scenario_and_the_shipped_policies() -> None:
    args = cli.build_parser().parse_args(["simulate"])
    assert cli._names(args.scenario, list(SCENARIOS), DEFAULT_SET, "--scenario") == list(SCENARIOS)
    policies = cli._names(args.policy, list(POLICIES), DEFAULT_POLICIES, "--policy")
    assert policies == ["fixed-480", "fixed-short", "vllm-lease", "kvproto"]
    # The historical release runs only when asked for.
    assert "vllm-v4" not in policies
    assert "vllm-v4" in cli._names("all", list(POLICIES), DEFAULT_POLICIES, "--policy")
    with pytest.raises(cli.UsageError):
        cli._names("nope", list(SCENARIOS), DEFAULT_SET, "--scenario")


def test_delegation(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["conformance", "--list"]) == 0
    assert "loopback" in capsys.readouterr().out
    assert cli._delegate("kvproto_tools.no_such_tool", [], "bench") == 2
    assert "not available" in capsys.readouterr().err


def test_python_dash_m_is_the_same_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvproto_tools", "simulate", "--help"],
        check=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    assert "--scenario" in out and "--liveness" in out


@pytest.mark.slow
def test_the_readme_command_runs_everything() -> None:
    """``kvproto simulate`` with no arguments: every scenario, the four shipped policies."""
    out = subprocess.run(
        [sys.executable, "-m", "kvproto_tools", "simulate"],
        check=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    assert f"= {len(SCENARIOS) * len(DEFAULT_POLICIES)} run(s)" in out
    for scenario in SCENARIOS:
        assert f"{scenario} - " in out  # its conclusion line
    assert "kvproto: no oracle violation" in out
