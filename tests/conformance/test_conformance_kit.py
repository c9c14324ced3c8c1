"""Reports (table, JSON shape, JUnit), the CLI, entry-point discovery, host memory."""

from __future__ import annotations

import importlib.metadata
import io
import json
import sys
import types
import xml.etree.ElementTree as ET
from collections.abc import Callable
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from kvproto_transports.conformance import (
    CaseResult,
    HostMemory,
    Level,
    Report,
    TransportFactory,
    UnknownTransport,
    Verdict,
    all_cases,
    available,
    cli,
    discovery,
    load_factory,
)
from kvproto_transports.conformance.docs import cases_markdown
from kvproto_transports.conformance.report import junit_xml, print_table
from kvproto_transports.loopback import LoopbackGroup


def result(
    case_id: str, level: Level, verdict: Verdict, measured: float | None = None
) -> CaseResult:
    return CaseResult(
        id=case_id,
        title=f"title {case_id}",
        group="Notifications",
        level=level,
        verdict=verdict,
        detail=f"detail <{case_id}> & more",
        measured=measured,
        duration_s=0.01,
    )


REPORT = Report(
    transport="demo",
    strict=False,
    cases=(
        result("T2.1", Level.MUST, Verdict.PASS),
        result("T2.2", Level.MUST, Verdict.FAIL, 3.0),
        result("T2.3", Level.SHOULD, Verdict.NON_STRICT),
        result("T2.4", Level.MUST, Verdict.UNSUPPORTED),
        result("T2.5", Level.MUST, Verdict.INFO, 0.25),
    ),
)


def test_json_has_exactly_the_documented_shape() -> None:
    doc = json.loads(json.dumps(REPORT.to_json()))
    assert set(doc) == {"transport", "cases", "summary"}
    assert doc["transport"] == "demo"
    for case in doc["cases"]:
        assert set(case) == {"id", "title", "level", "verdict", "detail", "measured"}
        assert case["level"] in {"MUST", "SHOULD", "INFO"}
        assert case["verdict"] in {"PASS", "NON-STRICT", "FAIL", "INFO", "UNSUPPORTED"}
        assert case["measured"] is None or isinstance(case["measured"], float)
    assert doc["cases"][1] == {
        "id": "T2.2",
        "title": "title T2.2",
        "level": "MUST",
        "verdict": "FAIL",
        "detail": "detail <T2.2> & more",
        "measured": 3.0,
    }
    assert doc["summary"] == {"PASS": 1, "NON-STRICT": 1, "FAIL": 1, "INFO": 1, "UNSUPPORTED": 1}
    assert REPORT.failed


def test_junit_marks_failures_and_skips() -> None:
    suite = ET.fromstring(junit_xml(REPORT))
    assert suite.tag == "testsuite"
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("5", "1", "1")
    cases = {tc.get("name"): tc for tc in suite.iter("testcase")}
    assert cases["T2.2 title T2.2"].find("failure") is not None
    assert cases["T2.2 title T2.2"].find("failure").get("message") == "detail <T2.2> & more"  # type: ignore[union-attr]
    assert cases["T2.4 title T2.4"].find("skipped") is not None
    assert cases["T2.3 title T2.3"].find("failure") is None
    assert "NON-STRICT" in (cases["T2.3 title T2.3"].findtext("system-out") or "")


def test_table_lists_every_case_and_the_summary() -> None:
    out = io.StringIO()
    print_table(REPORT, out)
    text = out.getvalue()
    for case_id in ("T2.1", "T2.2", "T2.3", "T2.4", "T2.5", "NON-STRICT", "UNSUPPORTED"):
        assert case_id in text
    assert "PASS 1  NON-STRICT 1  FAIL 1  INFO 1  UNSUPPORTED 1" in text


def test_cases_are_numbered_grouped_and_documented() -> None:
    cases = all_cases()
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)) >= 30
    assert ids[0] == "T0.1" and ids[-1].startswith("T6.")
    for c in cases:
        assert c.requirement and c.protects and c.title
        assert c.group in {
            "Declarations",
            "Identity and lifecycle",
            "Notifications",
            "Reads",
            "Peer failure",
            "Resources",
            "Writes (push mode)",
        }


def test_loopback_is_discovered_through_the_entry_point_group() -> None:
    assert "loopback" in available()
    factory = load_factory("loopback")
    assert isinstance(factory, TransportFactory) and factory.name == "loopback"
    with pytest.raises(UnknownTransport, match="loopback"):
        load_factory("no-such-transport")


def test_cli_runs_the_suite_and_writes_both_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_xml = tmp_path / "out.json", tmp_path / "out.xml"
    code = cli.main(
        [
            "--transport",
            "loopback",
            "--json",
            str(out_json),
            "--junit",
            str(out_xml),
            "--case",
            "T1",
            "--case",
            "T3.2",
        ]
    )
    assert code == 0
    doc = json.loads(out_json.read_text())
    assert [c["id"] for c in doc["cases"]] == [
        "T1.1",
        "T1.2",
        "T1.3",
        "T1.4",
        "T1.5",
        "T1.6",
        "T1.7",
        "T1.8",
        "T3.2",
    ]
    assert doc["summary"]["PASS"] == 9
    assert ET.parse(out_xml).getroot().get("tests") == "9"
    assert "T3.2" in capsys.readouterr().out


def test_cli_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--transport", "no-such-transport"]) == 2
    assert cli.main([]) == 2
    assert "no-such-transport" in capsys.readouterr().err
    assert cli.main(["--list"]) == 0
    assert "loopback" in capsys.readouterr().out


def _drop_empty(send: Callable[[str, bytes], None]) -> Callable[[str, bytes], None]:
    def flawed(peer: str, payload: bytes) -> None:
        if payload:
            send(peer, payload)

    return flawed


def test_cli_exits_1_when_a_must_case_fails_for_a_third_party_entry_point(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A third-party package registers its factory under "kvproto.transports"; here a
    # fake module stands in for it, with a transport that fails T2.2 (drops empty payloads).
    module = types.ModuleType("third_party_kvproto_transport")

    class DropsEmpty(LoopbackGroup):
        def __init__(self, size: int) -> None:
            super().__init__(size)
            for ep in self.loopback_endpoints:
                ep.send = _drop_empty(ep.send)  # type: ignore[method-assign,assignment]

    module.factory = lambda: TransportFactory(name="third", create_group=DropsEmpty)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    real = importlib.metadata.entry_points
    monkeypatch.setattr(
        discovery,
        "entry_points",
        lambda group: [
            *real(group=group),
            EntryPoint(name="third", value=f"{module.__name__}:factory", group=group),
        ],
    )
    assert cli.main(["--transport", "third", "--case", "T2.2"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_strict_is_reported_and_changes_exit_status() -> None:
    strict = Report(
        transport="demo", strict=True, cases=(result("T1.6", Level.SHOULD, Verdict.FAIL),)
    )
    assert strict.failed and strict.summary["FAIL"] == 1


def test_host_memory_gives_real_addresses_with_real_bytes() -> None:
    mem = HostMemory()
    layout = mem.allocate(num_regions=2, block_len=16, num_blocks=3)
    assert layout.num_regions == 2 and layout.block_lens == (16, 16)
    assert layout.region_addrs[0] != layout.region_addrs[1]
    mem.write_block(layout, 1, 2, b"\x00\xff" * 8)
    assert mem.read_block(layout, 1, 2) == b"\x00\xff" * 8
    assert mem.read_block(layout, 1, 1) == bytes(16)
    assert bytes(mem.buffer(layout.region_addrs[1]))[32:48] == b"\x00\xff" * 8
    with pytest.raises(ValueError):
        mem.write_block(layout, 0, 0, b"short")
    with pytest.raises(IndexError):
        mem.read_block(layout, 0, 3)


def test_the_authors_guide_documents_every_case() -> None:
    guide = (Path(__file__).parents[2] / "spec" / "transport-authors.md").read_text()
    assert cases_markdown() in guide  # regenerate: python -m kvproto_transports.conformance.docs
    for c in all_cases():
        assert f"**{c.id} {c.title}** ({c.level.value})" in guide, c.id
        assert c.protects in guide, c.id
