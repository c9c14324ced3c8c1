"""Same seed, same run: in one process, across processes, whatever the worker count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvproto_tools.sim import Simulator
from kvproto_tools.sim.sweep import plan, sweep

ROOT = Path(__file__).resolve().parents[2]


def _fingerprint(scenario: str, policy: str, seed: int) -> tuple[object, ...]:
    r = Simulator(scenario, policy, seed, liveness=True, timeline=True).run()
    return (
        json.dumps(r.to_json(), sort_keys=True),
        [(v.kind, v.time, v.detail, v.trace) for v in r.violations + r.liveness],
        r.timeline,
        r.extra,
    )


def test_same_seed_same_events_and_figures() -> None:
    for scenario, policy in (("lossy", "kvproto"), ("slow-forward", "vllm-lease")):
        assert _fingerprint(scenario, policy, 11) == _fingerprint(scenario, policy, 11)


def test_different_seeds_differ() -> None:
    a = Simulator("lossy", "kvproto", 1).run().metrics
    b = Simulator("lossy", "kvproto", 2).run().metrics
    assert a != b


def test_results_do_not_depend_on_worker_count() -> None:
    tasks = plan(["partition", "clock-skew"], ["kvproto", "fixed-short"], [4, 5])
    one = [r.to_json() for r in sweep(tasks, jobs=1)]
    two = [r.to_json() for r in sweep(tasks, jobs=2)]
    assert one == two


def test_replay_across_processes_and_hash_seeds(tmp_path: Path) -> None:
    outputs = []
    for hash_seed in ("1", "2"):
        out = tmp_path / f"runs{hash_seed}.json"
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        subprocess.run(
            [
                sys.executable,
                "-m",
                "kvproto_tools",
                "simulate",
                "--scenario",
                "lossy,prefill-restart",
                "--policy",
                "kvproto,vllm-lease",
                "--seed",
                "9",
                "--jobs",
                "1",
                "--json",
                str(out),
            ],
            check=True,
            env=env,
            cwd=ROOT,
            capture_output=True,
        )
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1]
