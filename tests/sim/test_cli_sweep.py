"""Big sweeps from the command line: they start at once, show progress, and keep no runs."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvproto_tools import cli
from kvproto_tools.sim import console
from kvproto_tools.sim.policies import DEFAULT_POLICIES
from kvproto_tools.sim.report import write_json
from kvproto_tools.sim.scenarios import SCENARIOS
from kvproto_tools.sim.sweep import plan, sweep
from tests.sim.test_cli_errors import ROOT

RSS_LIMIT_KB = 300_000
"""Far above the interpreter and one run in flight, far below a plan of 64 million tasks."""


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_a_million_seeds_start_at_once_in_bounded_memory() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvproto_tools.cli", "simulate", "--seeds", "1000000"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # its workers too are stopped below, by the group's id
    )
    assert proc.stdout is not None
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=15), "nothing printed within 15 s"
        first = proc.stdout.readline()
        runs = len(SCENARIOS) * len(DEFAULT_POLICIES) * 1_000_000
        assert f"1000000 seed(s) = {runs} run(s)" in first, first
        time.sleep(3)  # runs are under way: memory must not grow with the plan
        assert _rss_kb(proc.pid) < RSS_LIMIT_KB
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_streamed_report_and_json_equal_those_of_the_collected_runs(tmp_path: Path) -> None:
    """Runs aggregated and written as they stream in give the bytes of the whole list, with
    one worker or two."""
    args = ["--scenario", "normal,decode-crash", "--policy", "fixed-short,kvproto", "--seeds", "2"]
    outputs = []
    for jobs in ("1", "2"):
        out = tmp_path / f"runs{jobs}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "kvproto_tools.cli", "simulate", *args, "--jobs", jobs,
             "--json", str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        stable = [
            line
            for line in proc.stdout.splitlines()
            if not line.startswith(("Simulating", "wrote", "8 run(s) in"))
        ]
        outputs.append((out.read_bytes(), stable))
    assert outputs[0] == outputs[1]
    whole = tmp_path / "whole.json"
    tasks = plan(["normal", "decode-crash"], ["fixed-short", "kvproto"], [0, 1])
    write_json(sweep(tasks, jobs=1), whole)
    assert outputs[0][0] == whole.read_bytes()


def test_progress_off_a_terminal_is_a_line_now_and_then(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(console, "PLAIN_EVERY_S", 0.0)
    code = cli.main(
        ["simulate", "--scenario", "normal", "--policy", "fixed-480", "--seeds", "2", "--jobs", "1"]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert "kvproto simulate: 1/2 runs (50%)" in captured.err
    assert "kvproto simulate: 2/2 runs (100%)" in captured.err
    assert "runs (" not in captured.out  # the report's stream stays clean
