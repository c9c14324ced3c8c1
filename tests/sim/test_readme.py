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
