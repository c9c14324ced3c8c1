"""``kvproto conformance`` as a user types it: case ids, figures with units, install lines."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from kvproto_transports.conformance import all_cases, discovery
from kvproto_transports.conformance.registry import UNITS
from kvproto_transports.conformance.runner import run_conformance

ROOT = Path(__file__).resolve().parents[2]

HIDE = """
import sys
for name in sys.argv[1].split(","):
    if name:
        sys.modules[name] = None  # import of it raises ModuleNotFoundError, as when absent
from kvproto_tools.cli import main
raise SystemExit(main(sys.argv[2:]))
"""


def kvproto(*args: str, hide: str = "") -> subprocess.CompletedProcess[str]:
    """``kvproto ARGS`` in a fresh interpreter, with the modules in ``hide`` absent."""
    return subprocess.run(
        [sys.executable, "-c", HIDE, hide, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _pyproject_extra(extra: str) -> list[str]:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return sorted(doc["project"]["optional-dependencies"][extra])


def test_case_ids_match_whatever_their_letter_case(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = kvproto(
        "conformance", "--transport", "loopback", "--case", "t3.2", "--case", "t0", "--json",
        str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [c["id"] for c in json.loads(out.read_text(encoding="utf-8"))["cases"]] == [
        "T0.1",
        "T3.2",
    ]


def test_measured_figures_are_printed_with_their_unit() -> None:
    proc = kvproto(
        "conformance", "--transport", "loopback", "--case", "T2.3", "--case", "T2.6",
        "--case", "T2.9", "--case", "T4.1", hide="rich",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("T")}
    assert "[4096 B]" in rows["T2.3"]
    assert "[0 inversions]" in rows["T2.6"]
    assert re.search(r"\[\d+(\.\d+)? (ns|µs|ms)\]", rows["T2.9"]), rows["T2.9"]  # a short poll
    assert "[500 ms]" in rows["T4.1"]  # the loopback's declared detection delay
    assert "e-0" not in proc.stdout


def test_every_case_that_measures_a_figure_has_a_unit() -> None:
    report = run_conformance("loopback")
    measuring = {c.id for c in report.cases if c.measured is not None}
    assert measuring <= set(UNITS), measuring - set(UNITS)
    assert set(UNITS) <= {c.id for c in all_cases()}


@pytest.mark.parametrize("extra", sorted(discovery.EXTRAS_FALLBACK))
def test_install_lines_carry_pyprojects_pins(extra: str) -> None:
    """The installed metadata and the fallback both say what pyproject.toml pins."""
    assert list(discovery.EXTRAS_FALLBACK[extra]) == _pyproject_extra(extra)
    assert list(discovery.extra_requirements(extra)) == _pyproject_extra(extra)


@pytest.mark.parametrize(
    ("transport", "hide", "library"),
    [
        ("ucx", "ucxx", "ucxx-cu12"),
        ("nixl", "nixl,nixl_cu12,nixl_cu13,nixl_rocm", "nixl-cu12"),
    ],
)
def test_missing_library_names_the_extra_and_its_pins(
    transport: str, hide: str, library: str
) -> None:
    proc = kvproto("conformance", "--transport", transport, hide=hide)
    lines = proc.stderr.splitlines()
    assert (proc.returncode, len(lines), proc.stdout) == (2, 1, ""), proc.stderr
    line = lines[0]
    assert f"transport '{transport}' cannot start" in line
    assert f"pip install 'kvproto[{transport}]'" in line
    for req in _pyproject_extra(transport):
        assert req in line
    pinned = next(r for r in _pyproject_extra(transport) if r.startswith(library))
    assert line.count(library) == 1 and pinned in line  # no second, unpinned install line


def test_jobs_run_the_same_cases_to_the_same_verdicts_in_case_order(tmp_path: Path) -> None:
    alone = run_conformance("loopback", only=["T1", "T3"])
    seen: list[str] = []
    shared = run_conformance(
        "loopback", only=["T1", "T3"], jobs=2, on_result=lambda r: seen.append(r.id)
    )
    assert shared.transport == alone.transport == "loopback"
    assert [(c.id, c.verdict) for c in shared.cases] == [(c.id, c.verdict) for c in alone.cases]
    assert seen == [c.id for c in alone.cases] and len(seen) > 5
    out = kvproto(
        "conformance",
        "--transport",
        "loopback",
        "--case",
        "T1",
        "--jobs",
        "2",
        "--json",
        str(tmp_path / "r.json"),
    )
    assert out.returncode == 0, out.stderr
    assert {c["verdict"] for c in json.loads((tmp_path / "r.json").read_text())["cases"]} == {
        "PASS"
    }


@pytest.mark.parametrize("jobs", ["0", "-1", "two"])
def test_jobs_below_one_or_not_a_number_is_a_usage_error(jobs: str) -> None:
    out = kvproto("conformance", "--transport", "loopback", "--jobs", jobs)
    assert out.returncode == 2 and "--jobs" in out.stderr and "Traceback" not in out.stderr


def test_jobs_need_the_transports_name_not_a_factory_object() -> None:
    factory = discovery.load_factory("loopback")
    with pytest.raises(ValueError, match="entry-point name"):
        run_conformance(factory, jobs=2)
