"""``kvproto bench --suite``: choosing suites, and the engine suites' figures without engines.

The engine suites (``vllm-step``, ``http``) start real vLLM engines for
minutes, so they are not run here; what is checked is everything around the
engines: the hook timer, the figures' names and shape built from samples,
the suite choice and its errors. Speed is not asserted.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from kvproto_tools.bench import main
from kvproto_tools.bench.engine_suites import SuiteUnavailable, pd_cpu, threads_of
from kvproto_tools.bench.http_bench import HttpPlan, check, http_figures
from kvproto_tools.bench.plan import QUICK
from kvproto_tools.bench.step_bench import (
    ANCHOR,
    CONNECTORS,
    STEP_FULL,
    Window,
    expected_step_names,
    pooled,
    step_figures,
    window_order,
)
from kvproto_tools.bench.step_timing import TOTALS, hook_names, timed_connector_class
from kvproto_tools.bench.suite import expected_names

FIGURE_KEYS = ["name", "size", "value", "unit", "anchor", "anchor_value", "ratio"]


class _Role:
    def __init__(self, name: str) -> None:
        self.name = name


class _Connector:
    """The shape of a vLLM connector the timer relies on: ``_role.name`` and hook methods."""

    def __init__(self, role: str) -> None:
        self.warm_up()  # before the role is stored (vLLM's base stores it first): not timed
        self._role = _Role(role)
        self.log: list[str] = []

    def warm_up(self) -> None:
        pass

    def get_finished(self, ids: set[str]) -> set[str]:
        self.log.append("get_finished")
        return self.get_transfer_results(ids)  # a hook calling a hook, as stock's does

    def get_transfer_results(self, ids: set[str]) -> set[str]:
        self.log.append("get_transfer_results")
        return set(ids)

    def build_connector_meta(self, output: object) -> str:
        self.log.append("build_connector_meta")
        return "meta"

    def _helper(self) -> int:
        return 7

    @classmethod
    def build_stats(cls) -> str:
        return cls.__name__

    @staticmethod
    def layout() -> str:
        return "NHD"


def test_timed_class_counts_each_outer_hook_call_once_per_side() -> None:
    assert hook_names(_Connector) == [
        "build_connector_meta",
        "get_finished",
        "get_transfer_results",
        "warm_up",
    ]
    timed = timed_connector_class(_Connector, "Timed")
    assert timed.__name__ == "Timed" and issubclass(timed, _Connector)
    TOTALS.take()
    worker, scheduler = timed("WORKER"), timed("SCHEDULER")
    assert worker.get_finished({"a"}) == {"a"}  # the real method still runs
    assert scheduler.build_connector_meta(None) == "meta"
    assert worker._helper() == 7 and timed.build_stats() == "Timed" and timed.layout() == "NHD"
    ns, cpu_ns, hooks = TOTALS.take()
    assert worker.log == ["get_finished", "get_transfer_results"]
    assert set(hooks) == {("worker", "get_finished"), ("scheduler", "build_connector_meta")}
    assert hooks[("worker", "get_finished")][0] == 1  # the inner hook is inside the outer time
    assert ns["worker"] == hooks[("worker", "get_finished")][1] > 0
    assert ns["scheduler"] == hooks[("scheduler", "build_connector_meta")][1] > 0
    assert cpu_ns > 0  # the calling thread's CPU in both outer calls
    assert TOTALS.take()[:2] == ({"scheduler": 0, "worker": 0}, 0)  # take resets


def _windows(sizes: tuple[int, ...]) -> dict[tuple[str, str, int], Window]:
    out = {}
    for k, connector in enumerate(("kvproto", "stock")):
        for role in ("prefill", "decode"):
            for n in sizes:
                samples = [
                    (1_000 * (k + 1) + i, 2_000 + 10 * i, 5_000_000, 2_500 + i, 4_000_000)
                    for i in range(200)
                ]
                out[(connector, role, n)] = Window(
                    samples=samples, requests=n, wall_s=6.0, other_cpu_s=1.5 * k
                )
    return out


def test_step_figures_pair_kvproto_with_stock_at_every_role_and_size() -> None:
    sizes = (0, 100, 1_000)
    figures = step_figures(_windows(sizes), sizes)
    assert {f.name for f in figures} == expected_step_names()
    assert {(f.name, f.size) for f in figures} == {
        (name, n) for name in expected_step_names() for n in sizes
    }
    by = {(f.name, f.size): f for f in figures}
    for role in ("prefill", "decode"):
        for n in sizes:
            total = by[(f"vllm_step.{role}.connector", n)]
            parts = by[(f"vllm_step.{role}.scheduler", n)], by[(f"vllm_step.{role}.worker", n)]
            assert total.anchor == ANCHOR and total.unit == "us"
            assert total.value >= max(p.value for p in parts)
            assert by[(f"vllm_step.{role}.connector.p99", n)].value >= total.value
            # here kvproto's scheduler side is the cheaper one, so the total's verdict follows
            assert total.met is (total.value <= (total.anchor_value or 0))
            assert total.ratio is not None and total.ratio > 1
            cpu = by[(f"vllm_step.{role}.connector.cpu", n)]
            assert cpu.unit == "us" and cpu.met is (cpu.value <= (cpu.anchor_value or 0))
            others = by[(f"vllm_step.{role}.other_threads", n)]
            assert (others.value, others.anchor_value) == (0.0, 0.25) and others.ratio is None
        held = by[("vllm_step.prefill.held", n)]
        assert held.value == held.anchor_value == n and held.ratio is None
    for f in figures:
        assert list(f.to_json()) == FIGURE_KEYS


def test_step_figures_skip_a_size_only_one_connector_reached() -> None:
    windows = _windows((0,))
    del windows[("stock", "decode", 0)]
    names = {f.name for f in step_figures(windows, (0,))}
    assert names == {n for n in expected_step_names() if n.startswith("vllm_step.prefill")}


def test_windows_alternate_the_connectors_at_every_size() -> None:
    order = window_order(STEP_FULL)
    assert len(order) == len(STEP_FULL.sizes) * len(CONNECTORS) * STEP_FULL.alternations
    firsts = []
    for n in STEP_FULL.sizes:
        at_n = [c for size, c in order if size == n]
        assert all(at_n.count(c) == STEP_FULL.alternations for c in CONNECTORS)
        # never one connector twice in a row: the other pair holds still one window at most
        assert all(a != b for a, b in itertools.pairwise(at_n))
        firsts.append(at_n[0])
    assert set(firsts) == set(CONNECTORS)  # neither is always measured first
    assert [size for size, _ in order] == sorted(size for size, _ in order)  # sizes only grow


def test_a_cell_pools_its_windows_and_keeps_the_fewest_requests() -> None:
    a = Window(samples=[(1, 2, 3, 1, 2)], requests=100, wall_s=6.0, other_cpu_s=1.0)
    b = Window(samples=[(4, 5, 6, 3, 5), (7, 8, 9, 6, 8)], requests=99, wall_s=6.5, other_cpu_s=2.0)
    cell = pooled([a, b])
    assert list(cell.samples) == [(1, 2, 3, 1, 2), (4, 5, 6, 3, 5), (7, 8, 9, 6, 8)]
    assert cell.requests == 99  # a lease lost in one window shows in the figure
    assert (cell.wall_s, cell.other_cpu_s) == (12.5, 3.0)  # the cell's cores: 3.0 / 12.5


def test_threads_of_reads_every_thread_of_a_process_with_its_cpu_and_cores() -> None:
    done = threading.Event()
    waiter = threading.Thread(target=done.wait, name="kvproto-test-waiter")
    waiter.start()
    try:
        threads = threads_of(os.getpid())
    finally:
        done.set()
        waiter.join()
    _, cpu_s, cores = threads[os.getpid()]  # the main thread's id is the process id
    assert cpu_s > 0  # this test process has run Python for a while
    assert cores.replace("-", ",").split(",")[0].isdigit()  # "0-1", "3", ...
    assert waiter.native_id in threads  # every thread, not the main one alone


def _http_result(variant: str, r: int, ttft: float) -> dict[str, Any]:
    return {
        "variant": variant,
        "round": r,
        "requests": 8,
        "errors": 0,
        "equal_to_baseline": 8,
        "wall_s": 2.0,
        "per_request": 0.25,
        "ttft_p50": ttft,
        "ttft_p99": 2 * ttft,
        "e2e_p50": 3 * ttft,
        "e2e_p99": 4 * ttft,
        "threads": {"prefill": [], "decode": []},
    }


def test_http_figures_compare_kvproto_with_every_other_variant() -> None:
    results = [
        _http_result(v, r, t)
        for r in range(2)
        for v, t in (("kvproto", 0.2), ("stock", 0.5), ("stock-1t", 0.25))
    ]
    figures = http_figures(results)
    by = {f.name: f for f in figures}
    for other in ("stock", "stock-1t"):
        ttft = by[f"http.ttft_p50.vs_{other}"]
        assert ttft.unit == "ms" and ttft.value == pytest.approx(200.0)
        assert by[f"http.equal_to_baseline.vs_{other}"].value == 16
        assert by[f"http.errors.vs_{other}"].ratio is None
    assert by["http.ttft_p50.vs_stock"].ratio == pytest.approx(2.5)
    assert not any(".vs_kvproto" in name for name in by)


def test_http_plan_must_include_kvproto_and_known_variants() -> None:
    assert check(HttpPlan()) is None
    assert check(HttpPlan(variants=("stock",))) is not None
    assert check(HttpPlan(variants=("kvproto", "stock-9t"))) is not None
    assert check(HttpPlan(requests=0)) is not None


def test_a_missing_example_module_is_named() -> None:
    """The engine suites name what they need from the source tree instead of a traceback."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM not installed: the suite stops at that first")
    with pytest.raises(SuiteUnavailable, match="examples/pd_cpu"):
        pd_cpu("no_such_module")


def test_one_suite_alone_produces_its_figures_only(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    assert main(["--quick", "--suite", "memory", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["machine"]["suites"] == ["memory"]
    assert {f["name"] for f in doc["figures"]} == expected_names(QUICK, ["memory"])


def test_an_unknown_suite_is_refused_before_anything_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--suite", "core,warp"]) == 2
    assert (
        "--suite: choose from core, memory, transport, vllm-step, http" in capsys.readouterr().err
    )


def test_a_plot_without_the_core_suite_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--suite", "memory", "--plot", str(tmp_path / "s.png")]) == 2
    assert "--suite core" in capsys.readouterr().err
    assert not (tmp_path / "s.png").exists()
