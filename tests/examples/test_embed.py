"""examples/embed: the core embedded over the loopback transport and over a transport of one's
own, run as a newcomer runs them; the README's "Using the core" shows their code verbatim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from examples.embed import loopback, own_transport
from examples.embed.serve import STEP_S

ROOT = Path(__file__).resolve().parents[2]

# A minute queued (twice the lease: the heartbeats keep it), then read: the done frees
# prefill's blocks one step later and decode's read is confirmed when the answer lands.
QUEUED = "60.0 s: still held after 60 s queued: True"
BYTES = "decode blocks 0, 1 hold prefill's 5, 6: True"


def test_over_loopback_the_lease_outlives_the_queue_and_ends_on_the_done() -> None:
    # 1 ms links: the done reaches prefill in the next step, its answer decode in the one after.
    assert loopback.main() == [
        QUEUED,
        "60.1 s: prefill freed req-1 (DONE)",
        "60.2 s: decode read req-1, confirmed",
        BYTES,
    ]


def test_over_an_own_transport_the_lease_outlives_the_queue_and_ends_on_the_done() -> None:
    # Mailboxes deliver at once: both sides hear within the step after the read.
    assert own_transport.main() == [
        QUEUED,
        "60.1 s: prefill freed req-1 (DONE)",
        "60.1 s: decode read req-1, confirmed",
        BYTES,
    ]
    assert STEP_S == 0.1


@pytest.mark.parametrize("module", ["loopback", "own_transport"])
def test_each_runs_as_the_readme_says(module: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", f"examples.embed.{module}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert QUEUED in out and "(DONE)" in out and "confirmed" in out and BYTES in out


def test_the_readme_shows_the_examples_code_verbatim() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Using the core") :].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n# (examples/embed/\w+\.py)\n(.*?)```", section, re.DOTALL)
    assert {path for path, _ in blocks} == {"examples/embed/serve.py", "examples/embed/loopback.py"}
    for path, code in blocks:
        assert code in (ROOT / path).read_text(encoding="utf-8"), f"README's {path} drifted"
