"""``kvproto chaos`` off the happy path: one line on stderr, exit 2, nothing started or written."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sim.test_cli_errors import kvproto, one_error_line


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        ([], "the following arguments are required: --out"),
        (["--out", "/nonexistent/dir/run"], "directory /nonexistent/dir does not exist"),
        (["--out", "{tmp}/file"], "is a file, not a directory"),
        (["--out", "{tmp}", "--duration", "10s"], "--duration 10s: at least 60 s"),
        (["--out", "{tmp}", "--duration", "3 weeks"], "a number with s, m or h"),
        (["--out", "{tmp}", "--seed", "one"], "--seed 'one': not an integer"),
        (["--out", "{tmp}", "--rate", "0"], "--rate 0: must be positive"),
        (["--out", "{tmp}", "--faults", "partition,meteor"], "--faults 'partition,meteor': meteor"),
        (["--out", "{tmp}", "--faults", ","], "--faults ',': no kind"),
        (["--out", "{tmp}", "--lease", "3"], "heartbeat interval of 0"),
        (["--out", "{tmp}", "--check"], "has no history.json or baseline.json"),
        (["--out", "{tmp}", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_chaos_refuses_before_running(args: list[str], expect: str, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    line = one_error_line(kvproto("chaos", *argv), "chaos")
    assert expect in line, line
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # nothing written


def test_chaos_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    line = one_error_line(kvproto("chaos", "--out", str(tmp_path), hide="matplotlib"), "chaos")
    assert "pip install 'kvproto[tools]'" in line


def test_check_of_a_folder_that_holds_no_readable_run_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "history.json").write_text("{}")
    (tmp_path / "baseline.json").write_text("{}")
    line = one_error_line(kvproto("chaos", "--out", str(tmp_path), "--check"), "chaos")
    assert "holds no run this version reads" in line
