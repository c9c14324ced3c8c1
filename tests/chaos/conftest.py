"""The chaos tests: the short run's report goes to pytest's terminal summary, so CI's log has it."""

from __future__ import annotations

import pytest

REPORTS: list[str] = []
"""Reports of the chaos runs this session made."""


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if REPORTS:
        terminalreporter.section("chaos run (kvproto chaos)")
        for report in REPORTS:
            for line in report.splitlines():
                terminalreporter.write_line(line)
