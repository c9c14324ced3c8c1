"""The short chaos run, as CI runs it: ``kvproto chaos --duration 2m`` on the real deployment.

Two prefill engines and a decoder (``vllm serve``) behind vllm-router on hosts in
network namespaces, two minutes of mixed load with the seed's network faults (seed 8:
a link flap, a partition longer than the lease, loss, as they fit), then the checker
and the simulator. The command's exit status is the checker's verdict; the report
lands in pytest's terminal summary. The router alternates the two prefill engines
(round robin), so the run is also the suite's check that two prefill engines serve
through one router: both grant leases, and every answer equals the plain engine's.

No kills here: a killed engine's restart under the run's load took 150-170 s on CI's
2 cores, longer than a short run's load, which then measured an outage and nothing
else. Kills are in the deployment tests (tests/deploy: kill -9 of D and of P) and in
the 30-minute run, whose figures are in spec/chaos.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from kvproto_tools.chaos.checker import Verdict
from kvproto_tools.chaos.history import History
from kvproto_tools.netns import unavailable_reason
from tests.deploy.conftest import require_deployment

from .conftest import REPORTS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SEED = 8
DURATION = "2m"
FAULTS = "partition,loss,flap"


def test_two_minutes_of_faults_and_traffic_leave_nothing_wrong_and_nothing_stranded(
    tmp_path: Path,
) -> None:
    require_deployment()
    why = unavailable_reason()
    if why is not None:
        if os.environ.get("KVPROTO_REQUIRE_NETNS") == "1":
            pytest.fail(f"KVPROTO_REQUIRE_NETNS=1 but network namespaces: {why}")
        pytest.skip(f"the chaos run's hosts are network namespaces: {why}")
    started = time.monotonic()
    argv = ["--out", str(tmp_path), "--duration", DURATION, "--seed", str(SEED), "--faults", FAULTS]
    run = subprocess.run(
        [sys.executable, "-m", "kvproto_tools", "chaos", *argv],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    took = time.monotonic() - started
    report = (tmp_path / "report.txt").read_text() if (tmp_path / "report.txt").exists() else ""
    REPORTS.append(f"kvproto chaos {' '.join(argv[2:])}: {took:.0f} s in all\n{report}")
    assert run.returncode == 0, f"{report}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    verdict = msgspec.json.decode((tmp_path / "verdict.json").read_bytes(), type=Verdict)
    assert verdict.violations == [] and verdict.answers["wrong"] == 0
    assert verdict.answers["ok"] > 50 and sum(verdict.faults.values()) >= 2, verdict.answers
    assert (tmp_path / "chaos.png").stat().st_size > 10_000
    # Both prefill engines served: each one's grant counter rose (the run has no kills, so
    # one incarnation each; the largest sample is its count).
    grants: dict[str, float] = {}
    for sample in History.load(tmp_path / "history.json").samples:
        for e in sample.engines:
            got = (e.metrics or {}).get("vllm:kvproto_holder_grants_total", 0.0)
            grants[e.name] = max(grants.get(e.name, 0.0), got)
    assert grants.get("prefill-0", 0) > 0 and grants.get("prefill-1", 0) > 0, grants
