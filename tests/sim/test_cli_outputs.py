"""Where ``kvproto`` writes, as a user runs it: files it cannot write, pipes that close early.

An output path is opened for real before any work runs, so every way the kernel
refuses a write (a virtual file system, a device that is always full, a name too
long, a file where a directory should be) is one line and exit status 2 at once;
a reader that stops reading (``| head -1``) ends the output, not the command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sim.test_cli_errors import ROOT, kvproto, one_error_line

LONG_NAME = "x" * 300 + ".json"
"""Longer than any file system's name limit (255 bytes)."""


def _refused_by_kernel(path: str) -> bool:
    """Whether creating ``path`` fails here (so the case means what it says on this machine)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError:
        return True
    os.close(fd)
    os.unlink(path)
    return False


UNWRITABLE = [
    pytest.param("/sys/x.json", "cannot write there", id="sysfs"),
    pytest.param("/proc/x.json", "cannot write there", id="procfs"),
    pytest.param("/dev/full", "no space left on device", id="dev-full"),
    pytest.param("{tmp}/" + LONG_NAME, "file name too long", id="long-name"),
    pytest.param("README.md/x.json", "README.md is a file, not a directory", id="file-as-dir"),
    pytest.param(
        "README.md/sub/x.json", "README.md is a file, not a directory", id="file-as-dir-deeper"
    ),
]


def _usable(path: str) -> None:
    if path.startswith("/dev/full") and not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    if path.startswith(("/sys/", "/proc/")) and not _refused_by_kernel(path):
        pytest.skip(f"{path} can be created here")


@pytest.mark.parametrize(("path", "expect"), UNWRITABLE)
def test_simulate_json_that_cannot_be_written_is_refused_at_once(
    path: str, expect: str, tmp_path: Path
) -> None:
    path = path.replace("{tmp}", str(tmp_path))
    _usable(path)
    line = one_error_line(kvproto("simulate", "--json", path), "simulate")
    assert line.startswith(f"kvproto simulate: --json {path}: ") and expect in line
    assert "Traceback" not in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("path", "expect"),
    [
        pytest.param("/sys/x.png", "cannot write there", id="sysfs"),
        pytest.param("{tmp}/" + "y" * 300 + ".png", "file name too long", id="long-name"),
        pytest.param("README.md/h.png", "README.md is a file", id="file-as-dir"),
    ],
)
def test_simulate_plot_that_cannot_be_written_is_refused_at_once(
    path: str, expect: str, tmp_path: Path
) -> None:
    path = path.replace("{tmp}", str(tmp_path))
    _usable(path)
    line = one_error_line(kvproto("simulate", "--plot", path), "simulate")
    assert line.startswith(f"kvproto simulate: --plot {path}: ") and expect in line


@pytest.mark.parametrize(("path", "expect"), UNWRITABLE)
@pytest.mark.parametrize("option", ["--json", "--junit"])
def test_conformance_report_that_cannot_be_written_is_refused_at_once(
    option: str, path: str, expect: str, tmp_path: Path
) -> None:
    path = path.replace("{tmp}", str(tmp_path)).replace(
        ".json", ".xml" if option == "--junit" else ".json"
    )
    _usable(path)
    proc = kvproto("conformance", "--transport", "loopback", option, path)
    line = one_error_line(proc, "conformance")
    assert line.startswith(f"kvproto conformance: {option} {path}: ") and expect in line


def test_the_check_leaves_an_existing_file_alone_and_creates_none(tmp_path: Path) -> None:
    """The probe opens an existing file without truncating it and removes the file it made."""
    kept = tmp_path / "kept.json"
    kept.write_text("the previous sweep\n", encoding="utf-8")
    before = kept.stat()
    line = one_error_line(
        kvproto("simulate", "--json", str(kept), "--plot", "/nonexistent/d/h.png"), "simulate"
    )
    assert "directory /nonexistent/d does not exist" in line  # --json passed its check first
    assert kept.read_text(encoding="utf-8") == "the previous sweep\n"
    assert kept.stat().st_mtime_ns == before.st_mtime_ns
    new = tmp_path / "new.json"
    one_error_line(
        kvproto("simulate", "--json", str(new), "--plot", "/nonexistent/d/h.png"), "simulate"
    )
    assert list(tmp_path.iterdir()) == [kept]


def _into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvproto ARGS | head -0``: stdout is a pipe whose reader has already gone."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "kvproto_tools.cli", *args],
            cwd=ROOT,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        os.close(write_end)


def test_conformance_list_into_a_closed_pipe_is_no_error() -> None:
    proc = _into_closed_pipe("conformance", "--list")
    assert (proc.returncode, proc.stderr) == (0, "")


def test_simulate_into_a_closed_pipe_still_finishes_its_work(tmp_path: Path) -> None:
    """The report is lost with the pipe, the JSON is not, and the exit status is the run's."""
    out = tmp_path / "r.json"
    proc = _into_closed_pipe(
        "simulate", "--scenario", "normal", "--policy", "kvproto", "--json", str(out)
    )
    assert (proc.returncode, proc.stderr) == (0, "")
    assert [r["policy"] for r in json.loads(out.read_text(encoding="utf-8"))["runs"]] == ["kvproto"]


def test_simulate_head_gets_its_line_and_the_command_exits_0() -> None:
    """The shell's ``kvproto simulate | head -1``, with the reader closing after one line."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvproto_tools.cli",
            "simulate",
            "--scenario",
            "normal",
            "--policy",
            "fixed-480,kvproto",
            "--jobs",
            "1",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    code = proc.wait(timeout=300)
    assert first.startswith("Simulating 1 scenario(s) x 2 polic(ies)")
    assert (code, proc.stderr.read()) == (0, "")
