"""The README's first-hour material: its core snippet runs, its simulator table is a real run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvproto_tools.sim import readme

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_core_snippet_runs_as_printed() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README, re.DOTALL)
    snippet = next(b for b in blocks if "Holder(" in b)
    namespace: dict[str, object] = {}
    exec(compile(snippet, "README.md", "exec"), namespace)  # every name it uses is defined
    assert "ticket" in namespace and "reader" in namespace


@pytest.mark.slow
def test_the_simulator_table_is_what_the_runs_give() -> None:
    """Regenerate with ``python -m kvproto_tools.sim.readme --write README.md``."""
    block = readme.block_of(README)
    assert block is not None, "README.md lost its generated simulator table"
    assert block == readme.render(readme.run(jobs=2))


@pytest.mark.slow
def test_the_heartbeat_bytes_of_spec_benchmarks_are_what_the_runs_give() -> None:
    """The README's two heartbeat rows point to this table for the other scenarios."""
    from kvproto_tools.sim.scenarios import SCENARIOS
    from kvproto_tools.sim.sweep import plan, sweep

    text = (ROOT / "spec" / "benchmarks.md").read_text(encoding="utf-8")
    section = text[text.index("## Heartbeat bytes in the simulator") :].split("\n## ", 1)[0]
    shown = re.findall(
        r"^\| ([a-z0-9-]+) \| ([\d,]+) \(([\d,]+)\) \| ([\d,]+) \(([\d,]+)\) \|$",
        section,
        re.MULTILINE,
    )
    runs = {
        (r.scenario, r.policy): r.metrics
        for r in sweep(plan(list(SCENARIOS), ["vllm-lease", "kvproto"], [0]), jobs=2)
    }
    want = [
        (
            name,
            *(
                f"{int(runs[(name, p)][k]):,}"
                for p in ("vllm-lease", "kvproto")
                for k in ("heartbeat_bytes", "heartbeat_messages")
            ),
        )
        for name in SCENARIOS
    ]
    assert shown == want
    # The README says kvproto sends fewer heartbeat bytes in decode-overload only.
    fewer = [
        name
        for name in SCENARIOS
        if runs[(name, "kvproto")]["heartbeat_bytes"]
        < runs[(name, "vllm-lease")]["heartbeat_bytes"]
    ]
    assert fewer == ["decode-overload"]
