"""The plain engine's heap probe (``python -m kvproto_tools.chaos.engine_heap``).

The chaos run starts its engines with oneDNN's primitive cache off, so that the memory
judge sees a flat heap once a plain engine would have one. These tests hold the probe
to what spec/chaos.md ("Memory of a plain engine") reads off it: prompts of one
length leave the heap as it is, and with the cache off so do prompts of new lengths
once the first ones are past. The default cache's growth is vLLM's, measured by the
probe's full run, and not asserted here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvproto_tools.chaos.engine_heap import CHECKPOINTS, Config, main, measure, table
from tests.vllm.vllm_required import require_vllm

REQUESTS = 250
"""Enough for three checkpoints (60, 120, 250): about 10 s of prefills per engine."""


def test_a_request_count_out_of_range_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--requests", str(CHECKPOINTS[0] - 1)])
    assert exit_.value.code == 2
    assert f"--requests: {CHECKPOINTS[0]} to {CHECKPOINTS[-1]}" in capsys.readouterr().err


def test_the_table_has_a_row_per_checkpoint_and_a_column_per_configuration() -> None:
    points = {
        Config(lengths="fixed", cache=None): [
            {"at": 60, "in_use": 190.44, "free": 25.1},
            {"at": 120, "in_use": 190.5, "free": 25.6},
        ],
        Config(lengths="random", cache="0"): [
            {"at": 60, "in_use": 200.5, "free": 44.5},
            {"at": 120, "in_use": 218.6, "free": 51.9},
        ],
    }
    assert table(points).splitlines() == [
        "heap MiB, in use / free (mallinfo2), after N requests:",
        "requests  fixed lengths, default cache  random lengths, cache 0",
        "      60                      190 / 25                 200 / 44",
        "     120                      190 / 26                 219 / 52",
    ]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_vllm()
    from kvproto_tools.bench.engine_suites import pd_cpu

    built: Path = pd_cpu("tiny_model").build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    return built


@pytest.mark.vllm
@pytest.mark.parametrize(
    "config",
    [Config(lengths="fixed", cache=None), Config(lengths="random", cache="0")],
    ids=lambda c: c.label.replace(" ", "-").replace(",", ""),
)
def test_the_heap_in_use_stays_flat_after_the_first_shapes(model: Path, config: Config) -> None:
    points = measure(config, model, REQUESTS)
    assert [p["at"] for p in points] == [60, 120, REQUESTS]
    # 120 requests hold the random lengths' first ~50 batch shapes: vLLM's per-layer
    # caches of 32 are full, and with oneDNN's cache off nothing else keeps more.
    # Measured: +0.0 MiB (fixed, from 60) and -0.1 MiB (random, cache off, from 120).
    start = points[0] if config.lengths == "fixed" else points[1]
    grown = points[-1]["in_use"] - start["in_use"]
    assert abs(grown) < 1.0, f"{config.label}: in use grew {grown:+.2f} MiB: {points}"
