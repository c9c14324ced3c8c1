"""Smoke test of ``kvproto bench --quick``: every figure appears, with the documented shape.

Speed is not asserted here (timing targets live in the benchmark output);
only presence, shape and a few facts that hold on any machine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvproto_tools.bench import main
from kvproto_tools.bench.figures import Figure
from kvproto_tools.bench.plan import QUICK
from kvproto_tools.bench.suite import expected_names
from kvproto_tools.bench.transport_bench import figures_from_mapping

FIGURE_KEYS = ["name", "size", "value", "unit", "anchor", "anchor_value", "ratio"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, object], Path, str]:
    out = tmp_path_factory.mktemp("bench")
    json_path, png_path = out / "bench.json", out / "bench.png"
    rc = main(["--quick", "--no-transports", "--json", str(json_path), "--plot", str(png_path)])
    assert rc == 0
    return json.loads(json_path.read_text()), png_path, ""


def test_json_has_exactly_the_documented_shape(
    quick_run: tuple[dict[str, object], Path, str],
) -> None:
    doc, _, _ = quick_run
    assert list(doc) == ["machine", "figures"]
    assert isinstance(doc["machine"], dict) and doc["machine"]["quick"] is True
    figures = doc["figures"]
    assert isinstance(figures, list) and figures
    for fig in figures:
        assert list(fig) == FIGURE_KEYS
        assert isinstance(fig["name"], str)
        assert fig["size"] is None or isinstance(fig["size"], int)
        assert isinstance(fig["value"], (int, float)) and math.isfinite(fig["value"])
        assert isinstance(fig["unit"], str) and fig["unit"]
        assert fig["anchor"] is None or isinstance(fig["anchor"], str)
        if fig["anchor_value"] is None:
            assert fig["ratio"] is None
        if fig["ratio"] is not None:
            assert fig["ratio"] == pytest.approx(fig["anchor_value"] / fig["value"], rel=1e-3)


def test_every_figure_name_is_produced(quick_run: tuple[dict[str, object], Path, str]) -> None:
    doc, _, _ = quick_run
    names = {f["name"] for f in doc["figures"]}  # type: ignore[attr-defined]
    missing = expected_names(QUICK) - names
    assert not missing, f"figures not produced: {sorted(missing)}"
    sizes = {f["size"] for f in doc["figures"] if f["name"] == "holder.idle_step"}  # type: ignore[attr-defined]
    assert sizes == set(QUICK.holder_sizes)


def test_size_independent_facts(quick_run: tuple[dict[str, object], Path, str]) -> None:
    """What holds on any machine: bytes are exact, and the text heartbeat is ~49 B per id."""
    doc, _, _ = quick_run
    by = {(f["name"], f["size"]): f for f in doc["figures"]}  # type: ignore[attr-defined]
    for n in QUICK.holder_sizes:
        hb = by[("holder.heartbeat_bytes_per_lease", n)]
        assert hb["anchor_value"] == pytest.approx(49, abs=0.1)  # 48-char ids plus a comma
        assert hb["value"] * n < 64  # one steady frame, whatever n is
        assert by[("holder.claim_ticks", n)]["value"] >= 1


def test_plot_is_a_png(quick_run: tuple[dict[str, object], Path, str]) -> None:
    _, png, _ = quick_run
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_transport_results_become_figures() -> None:
    """The NIXL/UCX ``measure_overhead()`` dicts map onto figures, whichever form they take."""
    got = figures_from_mapping(
        "transport.nixl",
        {
            "config": {"iterations": 10, "nixl_module": "nixl_cu12._api"},
            "notif_rtt_raw": {"median_us": 80.0, "p10_us": 70.0},
            "notif_rtt_transport": {"median_us": 100.0, "p10_us": 90.0},
            "notif_rtt_overhead_ratio": 1.25,
            "notif_rtt_us": 12.5,
            "read64": {"value": 3.0, "unit": "ms", "anchor": "raw nixl", "anchor_value": 2.5},
            "ready": Figure(name="transport.nixl.x", size=None, value=1.0, unit="us"),
            "label": "not a number",
        },
    )
    assert [f.name for f in got] == [
        "transport.nixl.notif_rtt",
        "transport.nixl.notif_rtt_us",
        "transport.nixl.read64",
        "transport.nixl.x",
    ]
    assert got[0].value == 100.0 and got[0].anchor_value == 80.0 and got[0].unit == "us"
    assert got[1].unit == "us"
    assert got[2].ratio == pytest.approx(2.5 / 3.0)
