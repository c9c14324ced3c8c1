"""Render a :class:`Report`: a summary table, the JSON shape, JUnit XML."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TextIO

from kvproto_transports.conformance.model import CaseResult, Report, Verdict
from kvproto_transports.conformance.registry import UNITS

STYLE = {
    Verdict.PASS: "green",
    Verdict.NON_STRICT: "yellow",
    Verdict.FAIL: "bold red",
    Verdict.INFO: "cyan",
    Verdict.UNSUPPORTED: "dim",
}


_SUBSECOND = ((1e-6, 1e-9, "ns"), (1e-3, 1e-6, "µs"), (1.0, 1e-3, "ms"))
"""(below this many seconds, divide by, unit): a time is shown in the unit it reads best in."""


def measured_text(c: CaseResult) -> str:
    """The measured figure with its unit (``7.96 µs``, ``4096 B``, ``0 inversions``)."""
    if c.measured is None:
        return ""
    return with_unit(c.measured, UNITS.get(c.id))


def with_unit(value: float, unit: str | None) -> str:
    """``value`` in ``unit``, three significant digits; seconds scaled down to ns, µs or ms."""
    if unit == "s":
        for below, scale, name in _SUBSECOND:
            if abs(value) < below:
                return f"{value / scale:.3g} {name}"
        return f"{value:.3g} s"
    if unit is None:
        return f"{value:.6g}"
    if math.isfinite(value) and value == int(value):
        return f"{int(value)} {unit}"
    return f"{value:.3g} {unit}"


def print_table(report: Report, out: TextIO | None = None) -> None:
    """Print the summary table (rich if installed, plain text otherwise)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        _print_plain(report, out)
        return
    table = Table(
        title=f"kvproto transport conformance: {report.transport}"
        + (" (strict)" if report.strict else "")
    )
    for col in ("ID", "Level", "Verdict", "Title", "Measured", "Detail"):
        table.add_column(col, overflow="fold")
    for c in report.cases:
        table.add_row(
            c.id,
            c.level.value,
            f"[{STYLE[c.verdict]}]{c.verdict.value}[/]",
            c.title,
            measured_text(c),
            c.detail,
        )
    console = Console(file=out)
    if not console.is_terminal:  # CI logs: do not wrap every cell at 80 columns
        console = Console(file=out, width=160)
    console.print(table)
    console.print(summary_line(report))


def _print_plain(report: Report, out: TextIO | None) -> None:
    lines = [f"kvproto transport conformance: {report.transport}"]
    for c in report.cases:
        lines.append(
            f"{c.id:<6} {c.level.value:<6} {c.verdict.value:<11} {c.title} "
            f"[{measured_text(c)}] {c.detail}"
        )
    lines.append(summary_line(report))
    print("\n".join(lines), file=out)


def summary_line(report: Report) -> str:
    """``PASS 24  NON-STRICT 0  FAIL 0  INFO 1  UNSUPPORTED 0``."""
    return "  ".join(f"{k} {v}" for k, v in report.summary.items())


def write_json(report: Report, path: str | Path) -> None:
    """Write :meth:`Report.to_json` to ``path``."""
    Path(path).write_text(json.dumps(report.to_json(), indent=2) + "\n")


def junit_xml(report: Report) -> str:
    """JUnit XML: FAIL is a failure, UNSUPPORTED a skip, the rest pass (verdict in system-out)."""
    s = report.summary
    suite = ET.Element(
        "testsuite",
        {
            "name": f"kvproto-conformance.{report.transport}",
            "tests": str(len(report.cases)),
            "failures": str(s[Verdict.FAIL.value]),
            "skipped": str(s[Verdict.UNSUPPORTED.value]),
            "errors": "0",
            "time": f"{sum(c.duration_s for c in report.cases):.3f}",
        },
    )
    for c in report.cases:
        tc = ET.SubElement(
            suite,
            "testcase",
            {
                "classname": f"{report.transport}.{c.group}",
                "name": f"{c.id} {c.title}",
                "time": f"{c.duration_s:.3f}",
            },
        )
        if c.verdict is Verdict.FAIL:
            failure = ET.SubElement(tc, "failure", {"message": c.detail, "type": c.level.value})
            failure.text = c.detail
        elif c.verdict is Verdict.UNSUPPORTED:
            ET.SubElement(tc, "skipped", {"message": c.detail})
        measured = "" if c.measured is None else f" measured={c.measured} ({measured_text(c)})"
        ET.SubElement(
            tc, "system-out"
        ).text = f"{c.verdict.value} [{c.level.value}]{measured}: {c.detail}"
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"


def write_junit(report: Report, path: str | Path) -> None:
    """Write :func:`junit_xml` to ``path``."""
    Path(path).write_text(junit_xml(report))
