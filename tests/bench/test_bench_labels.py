"""``kvproto bench``'s anchors are named as the simulator names vLLM's policies.

``vllm-lease`` is vLLM 0.32.0 as shipped (the full-scan reaper) and ``vllm-v4``
the historical release whose reaper stops at the first live entry
(spec/simulator.md's policy table): a reader of both tools must not meet one
name for two things.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvproto_tools.sim.policies import POLICIES

ROOT = Path(__file__).resolve().parents[2]


def test_baseline_anchors_use_the_simulators_policy_names(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvproto_tools.cli", "bench", "--quick", "--suite", "core",
         "--no-transports", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    anchors = {f["name"]: f["anchor"] for f in json.loads(out.read_text())["figures"]}
    full_scan = anchors["holder.idle_step"]
    head_stop = anchors["holder.idle_step.vs_head_stop"]
    assert full_scan.startswith("vllm-lease ") and "full-scan" in full_scan
    assert head_stop.startswith("vllm-v4 ") and "head-stop" in head_stop
    for name, anchor in anchors.items():
        if anchor and anchor.startswith("vllm"):
            policy = anchor.split()[0]
            assert policy in POLICIES, (name, anchor)
            assert policy == "vllm-lease" or "head-stop" in anchor, (name, anchor)
