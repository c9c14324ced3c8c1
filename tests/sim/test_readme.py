"""The README's first-hour material: its core snippet runs, its simulator table is a real run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs import readme_table as readme

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_core_snippet_runs_as_printed() -> None:
    """The embedding code of "Using the core", run with the names its text says it imports."""
    section = README[README.index("## Using the core") :].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    from collections.abc import Callable

    from kvproto import Holder, LeaseConfig, Reader, ReadGo, Transport
    from kvproto_binding import Binding
    from kvproto_transports import LinkFaults, LoopbackNetwork

    namespace: dict[str, object] = {
        "Callable": Callable,
        "Holder": Holder,
        "LeaseConfig": LeaseConfig,
        "Reader": Reader,
        "ReadGo": ReadGo,
        "Transport": Transport,
        "Binding": Binding,
        "LinkFaults": LinkFaults,
        "LoopbackNetwork": LoopbackNetwork,
        "STEP_S": 0.1,
        "BLOCK": 64,
    }
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # every name it uses is defined
    main = namespace["main"]
    assert callable(main)
    happened = main()
    assert "60.0 s: still held after 60 s queued: True" in happened
    assert "60.1 s: prefill freed req-1 (DONE)" in happened
    assert happened[-1] == "decode blocks 0, 1 hold prefill's 5, 6: True"


@pytest.mark.slow
def test_the_simulator_table_is_what_the_runs_give() -> None:
    """Regenerate with ``python -m tests.docs.readme_table --write README.md``."""
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
