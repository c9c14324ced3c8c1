"""The ``kvproto`` command off the happy path, as a user runs it (subprocesses).

Every mistake is one line on stderr and exit status 2, found before any work
runs (nothing on stdout, no file written); without the optional dependencies
the commands still work or name the extra to install.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

HIDE = """
import sys
for name in sys.argv[1].split(","):
    if name:
        sys.modules[name] = None  # import of it raises ModuleNotFoundError, as when absent
from kvproto_tools.cli import main
raise SystemExit(main(sys.argv[2:]))
"""
"""Runs the real ``kvproto`` command with some modules made unimportable."""


def kvproto(*args: str, hide: str = "", timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``kvproto ARGS`` in a fresh interpreter, with the modules in ``hide`` absent."""
    return subprocess.run(
        [sys.executable, "-c", HIDE, hide, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def one_error_line(proc: subprocess.CompletedProcess[str], command: str) -> str:
    """Assert exit status 2, nothing on stdout and exactly one line on stderr; return it."""
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"kvproto {command}: "), lines[0]
    assert proc.stdout == "", proc.stdout  # nothing ran
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--json", "/nonexistent/dir/r.json"], "directory /nonexistent/dir does not exist"),
        (["--plot", "/nonexistent/dir/h.png"], "directory /nonexistent/dir does not exist"),
        (["--plot", "{tmp}/x.txt"], "unsupported suffix '.txt'"),
        (["--plot", "{tmp}/noext"], "no suffix"),
        (["--json", "{tmp}"], "is a directory"),
        (["--scenario="], "--scenario is empty"),
        (["--scenario", ","], "--scenario is empty"),
        (["--policy="], "--policy is empty"),
        (["--scenario", "nope"], "unknown --scenario nope"),
        (["--seeds", "0"], "--seeds must be at least 1"),
        (["--jobs", "0"], "--jobs must be at least 1"),
    ],
)
def test_simulate_refuses_before_running(args: list[str], expect: str, tmp_path: Path) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    line = one_error_line(kvproto("simulate", *argv), "simulate")
    assert expect in line
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--transport", "loopback", "--case", "T99"], "--case T99 matches no case"),
        (["--transport", "loopback", "--case", "T1.1", "--case", "X"], "--case X matches no"),
        (["--transport", "loopback", "--case="], "--case is empty"),
        (["--transport", "loopback", "--json", "/nonexistent/d/c.json"], "does not exist"),
        (["--transport", "loopback", "--junit", "/nonexistent/d/c.xml"], "does not exist"),
        (["--transport", "nope"], "no transport 'nope'"),
        ([], "--transport NAME is required"),
    ],
)
def test_conformance_refuses_before_running(args: list[str], expect: str) -> None:
    assert expect in one_error_line(kvproto("conformance", *args), "conformance")


def test_conformance_without_nixl_says_what_to_install() -> None:
    hidden = "nixl,nixl_cu12,nixl_cu13,nixl_rocm"
    line = one_error_line(kvproto("conformance", "--transport", "nixl", hide=hidden), "conformance")
    assert "transport 'nixl' cannot start" in line and "pip install 'kvproto[nixl]'" in line


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--json", "/nonexistent/d/b.json"], "directory /nonexistent/d does not exist"),
        (["--plot", "/nonexistent/d/b.png"], "directory /nonexistent/d does not exist"),
        (["--plot", "{tmp}/b.txt"], "unsupported suffix '.txt'"),
    ],
)
def test_bench_refuses_before_measuring(args: list[str], expect: str, tmp_path: Path) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert expect in one_error_line(kvproto("bench", "--quick", *argv), "bench")


def test_version_is_the_distributions() -> None:
    """One source of truth: the distribution's version is read from kvproto.__version__."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^dynamic = \["version"\]$', pyproject, re.MULTILINE)
    assert '[tool.hatch.version]\npath = "kvproto/__init__.py"' in pyproject
    init = (ROOT / "kvproto" / "__init__.py").read_text(encoding="utf-8")
    declared = re.search(r'^__version__ = "([^"]+)"$', init, re.MULTILINE)
    assert declared is not None
    proc = kvproto("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"kvproto {declared.group(1)}"


def test_works_without_the_tools_extra(tmp_path: Path) -> None:
    """No rich, no matplotlib: help and the simulator work in plain text; --plot and bench
    name the extra in one line."""
    hidden = "rich,matplotlib"
    help_ = kvproto("--help", hide=hidden)
    assert help_.returncode == 0 and "simulate" in help_.stdout
    run = kvproto(
        "simulate",
        "--scenario",
        "slow-forward",
        "--policy",
        "vllm-lease,kvproto",
        "--jobs",
        "1",
        "--json",
        str(tmp_path / "r.json"),
        hide=hidden,
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "kvproto simulate - per run" in out and "Conclusions" in out
    assert "slow-forward  vllm-lease" in out  # a plain-text table row
    assert "[red]" not in out and "[/" not in out and "\x1b[" not in out  # no markup left
    assert (tmp_path / "r.json").is_file()
    plot = kvproto("simulate", "--plot", str(tmp_path / "h.png"), hide=hidden)
    assert "pip install 'kvproto[tools]'" in one_error_line(plot, "simulate")
    bench = kvproto("bench", "--quick", hide=hidden)
    assert "pip install 'kvproto[tools]'" in one_error_line(bench, "bench")
    conformance = kvproto("conformance", "--transport", "loopback", "--case", "T1.1", hide=hidden)
    assert conformance.returncode == 0 and "T1.1" in conformance.stdout
