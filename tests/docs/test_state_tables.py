"""spec/state-tables.md is generated from kvproto/states.py and must never drift from it."""

from __future__ import annotations

from pathlib import Path

from .state_tables import render

SPEC = Path(__file__).resolve().parents[2] / "spec" / "state-tables.md"


def test_committed_state_tables_match_the_code() -> None:
    assert SPEC.read_text() == render(), (
        "run: python -m tests.docs.state_tables > spec/state-tables.md"
    )
