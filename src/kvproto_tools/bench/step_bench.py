"""``--suite vllm-step``: what the KV connector adds to each step of a real vLLM engine.

Per connector (kvproto, then stock NixlConnector, same run), one P/D pair of
real vLLM CPU engines on the tiny Llama (:mod:`.step_engine`), both stepping
all along with a background decode. At each size N, P has prefilled N
requests for D and holds their blocks, and D has the N requests queued
(tracked by its connector, heartbeating P's leases, never scheduled). For a
window of wall time every engine step is sampled: the time spent in the
connector's scheduler-side and worker-side hooks (:mod:`.step_timing`) and
the whole step. Sizes grow in one engine pair (0, then 100 more, then 900
more), so the state at N is real: P's held and D's queued counts are figures
too, read from the schedulers.

Both connectors run with the timing wrapper, so its ~0.2 us per hook call is
in both columns alike.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvproto_tools.bench.engine_suites import pd_cpu
from kvproto_tools.bench.figures import Figure
from kvproto_tools.bench.step_engine import EngineArgs, EngineChild, Sample
from kvproto_tools.bench.timing import percentile

Say = Callable[[str], None]

CONNECTORS = ("kvproto", "stock")
"""kvproto's connector and its anchor, stock NixlConnector, in this order."""
ANCHOR = "stock NixlConnector"
ROLES = {"prefill": "P", "decode": "D"}
"""Figure role -> engine."""
PROMPT_SENTENCES = 3
"""~40 tokens: one full 32-token block (stock holds full blocks only) and a partial one."""
PREFILL_SEQS = 64
"""P's running requests: prefills go in batches of this beside the background request."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPlan:
    """Sizes and windows of one ``vllm-step`` run."""

    sizes: tuple[int, ...]
    """Requests held on P and tracked on D, ascending (each size adds to the last)."""
    window_s: float
    """Wall time sampled at each size (covers heartbeat rounds: stock sends every 5 s)."""
    settle_s: float
    """Wait after D enqueues, before the window (first heartbeats, handshakes)."""
    lease_s: int = 30
    """``kv_lease_duration`` of both connectors (vLLM's default)."""


STEP_FULL = StepPlan(sizes=(0, 100, 1_000), window_s=12.0, settle_s=3.0)
STEP_QUICK = StepPlan(sizes=(0, 100, 1_000), window_s=4.0, settle_s=1.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Window:
    """One connector's samples on one engine at one size."""

    samples: Sequence[Sample]
    """One per engine step in the window."""
    requests: int
    """Held (P) or queued (D) when the window closed, read from the scheduler."""


Windows = Mapping[tuple[str, str, int], Window]
"""(connector, role, size) -> window."""


def _us(ns: Sequence[int], q: float) -> float:
    return percentile(ns, q) / 1_000.0


def step_figures(windows: Windows, sizes: Sequence[int]) -> list[Figure]:
    """Figures of kvproto beside stock at every (role, size) both were measured at."""
    figures: list[Figure] = []
    for role in ROLES:
        for n in sizes:
            ours, stock = windows.get(("kvproto", role, n)), windows.get(("stock", role, n))
            if ours is None or stock is None:
                continue
            figures += _pair(role, n, ours, stock)
    return figures


def _pair(role: str, n: int, ours: Window, stock: Window) -> list[Figure]:
    base = f"vllm_step.{role}"

    def columns(w: Window) -> dict[str, list[int]]:
        return {
            "scheduler": [s[0] for s in w.samples],
            "worker": [s[1] for s in w.samples],
            "connector": [s[0] + s[1] for s in w.samples],
            "engine_step": [s[2] for s in w.samples],
        }

    a, b = columns(ours), columns(stock)

    def fig(name: str, column: str, q: float, target: bool) -> Figure:
        value, anchor_value = _us(a[column], q), _us(b[column], q)
        return Figure(
            name=f"{base}.{name}",
            size=n,
            value=value,
            unit="us",
            anchor=ANCHOR,
            anchor_value=anchor_value,
            target="ratio >= 1" if target else None,
            met=(value <= anchor_value) if target else None,
        )

    what = "held" if role == "prefill" else "queued"
    return [
        fig("connector", "connector", 0.5, True),
        fig("connector.p99", "connector", 0.99, True),
        fig("scheduler", "scheduler", 0.5, False),
        fig("worker", "worker", 0.5, False),
        fig("engine_step", "engine_step", 0.5, False),
        Figure(
            name=f"{base}.{what}",
            size=n,
            value=float(ours.requests),
            unit="requests",
            anchor=ANCHOR,
            anchor_value=float(stock.requests),
            comparable=False,
        ),
        Figure(
            name=f"{base}.steps",
            size=n,
            value=float(len(ours.samples)),
            unit="steps",
            anchor=ANCHOR,
            anchor_value=float(len(stock.samples)),
            comparable=False,
        ),
    ]


def expected_step_names() -> set[str]:
    """Every figure name a ``vllm-step`` run produces."""
    tails = ("connector", "connector.p99", "scheduler", "worker", "engine_step", "steps")
    names = {f"vllm_step.{role}.{t}" for role in ROLES for t in tails}
    return names | {"vllm_step.prefill.held", "vllm_step.decode.queued"}


def _engine_args(
    cluster: Any, model: Path, connector: str, plan: StepPlan
) -> tuple[EngineArgs, EngineArgs]:
    """P's and D's engines: ports and cores as examples/pd_cpu lays them out, timed connector."""
    (prefill,), decode = cluster.default_layout(1, base_port=None, decode_seqs=1)

    def args(spec: Any, park: bool) -> EngineArgs:
        kv = cluster.kv_transfer_config(connector, spec.role, lease_s=plan.lease_s)
        if connector == "stock":  # stock's default lease; kvproto's is set in its extra config
            kv["kv_connector_extra_config"]["kv_lease_duration"] = plan.lease_s
        kv["kv_connector_module_path"] = "kvproto_tools.bench.step_connectors"
        env = cluster.engine_env(spec, shim=None, base={})
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING")
        return EngineArgs(
            model=str(model), kv_transfer_config=kv, env=env, park=park, max_num_seqs=PREFILL_SEQS
        )

    return args(prefill, False), args(decode, True)


def _run_connector(
    connector: str, model: Path, plan: StepPlan, prompt: Callable[[int], str], say: Say
) -> dict[tuple[str, str, int], Window]:
    cluster = pd_cpu("cluster")
    p_args, d_args = _engine_args(cluster, model, connector, plan)
    p, d = EngineChild(f"{connector}-P", p_args), EngineChild(f"{connector}-D", d_args)
    out: dict[tuple[str, str, int], Window] = {}
    try:
        start = time.monotonic()
        p.call("start")
        d.call("start")
        say(f"vllm-step: {connector} engines up in {time.monotonic() - start:.0f} s")
        have = 0
        for n in plan.sizes:
            ids = [f"{connector}-{i}" for i in range(have, n)]
            if ids:
                prompts = [prompt(i) for i in range(have, n)]
                params = p.call("prefill", request_ids=ids, prompts=prompts)
                d.call("park", request_ids=ids, prompts=prompts, params=params)
                have = n
            time.sleep(plan.settle_s)
            p.call("take")
            d.call("take")
            time.sleep(plan.window_s)
            for role, engine in (("prefill", p), ("decode", d)):
                got = engine.call("take")
                state = engine.call("state")
                count = state["held"] if role == "prefill" else state["waiting"]
                out[(connector, role, n)] = Window(samples=got["samples"], requests=count)
                say(
                    f"vllm-step: {connector:>7} {role:>7} N={n:<5,} {len(got['samples']):>4} "
                    f"steps, {state}; median per step: {_top_hooks(got['hook_median_ns'])}"
                )
    finally:
        d.stop()  # the reader first: its heartbeats would only fail against a stopped P
        p.stop()
    return out


def _top_hooks(median_ns: Mapping[str, float]) -> str:
    """Every hook with a median of at least 1 us per step, largest first, in microseconds:
    the whole per-hook breakdown that the connector column sums (the rest is noise)."""
    top = sorted(((k, v) for k, v in median_ns.items() if v >= 1_000), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {ns / 1e3:.1f} us" for name, ns in top)


def measure(plan: StepPlan, say: Say) -> list[Figure]:
    """Both connectors' windows, then the figures (kvproto beside stock)."""
    tiny = pd_cpu("tiny_model")
    with tempfile.TemporaryDirectory(prefix="kvproto-vllm-step-") as tmp:
        model = tiny.build_tiny_llama(Path(tmp) / "model")

        def prompt(i: int) -> str:
            return f"step {i}: " + str(tiny.make_prompt(PROMPT_SENTENCES))

        windows: dict[tuple[str, str, int], Window] = {}
        for connector in CONNECTORS:
            windows.update(_run_connector(connector, model, plan, prompt, say))
    return step_figures(windows, plan.sizes)
