"""spec/state-tables.md is generated from kvproto/states.py and must never drift from it."""

from __future__ import annotations

from pathlib import Path

from kvproto.diagrams import render

SPEC = Path(__file__).resolve().parents[2] / "spec" / "state-tables.md"


def test_committed_state_tables_match_the_code() -> None:
    assert SPEC.read_text() == render(), "run: python -m kvproto.diagrams > spec/state-tables.md"


def test_every_table_row_appears_in_the_spec() -> None:
    from kvproto.states import LEASE_TRANSITIONS

    text = render()
    for (state, _), _dst in LEASE_TRANSITIONS.items():
        assert f"**{state.name}**" in text
