"""``--suite vllm-step``: what the KV connector adds to each step of a real vLLM engine.

Per connector (kvproto and stock NixlConnector, same run), one P/D pair of
real vLLM CPU engines on the tiny Llama (:mod:`.step_engine`), each stepping
with a background decode. At each size N, P has prefilled N requests for D
and holds their blocks, and D has the N requests queued (tracked by its
connector, heartbeating P's leases, never scheduled). For a window of wall
time every engine step is sampled: the time spent in the connector's
scheduler-side and worker-side hooks (:mod:`.step_timing`) and the whole
step. Sizes grow in each engine pair (0, then 100 more, then 900 more), so
the state at N is real: P's held and D's queued counts are figures too, read
from the schedulers.

Both pairs are alive all along (four engines, ~1.7 GB each) and measured in
alternation (:func:`window_order`), so a load that comes and goes on the
machine falls on both columns alike. Only the measured pair runs: the other
is frozen once it stopped stepping (:meth:`.EngineChild.hold`), as stock's
NIXL progress threads keep cores busy even while their engine holds still,
which would load kvproto's windows with stock's cost. Each cell pools its
windows' steps.

Both connectors run with the timing wrapper, so its ~0.2 us per hook call is
in both columns alike.

What is compared: the engine thread's time inside the connector's hooks per
step, both in wall time (``connector``: what the step waits for) and in that
thread's CPU time (``connector.cpu``: the same minus any time the thread was
descheduled, so a column whose core is busier with other threads is not
charged for them). Both columns' engines run on the same cores
(:mod:`.step_engine`), and each column's whole step (``engine_step``, wall and
CPU) and the CPU its process's other threads used in the window
(``other_threads``, in cores: stock's NIXL/UCX threads, OpenMP, kvproto's side
channel) are figures beside it, so a ratio can be read against step lengths.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvproto_tools.bench.engine_suites import pd_cpu, threads_of
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
    """Wall time sampled per window (one connector, one size, one alternation); the
    alternations of a cell together cover heartbeat rounds (stock sends every 5 s)."""
    settle_s: float
    """Wait after both pairs got a size's requests, before its first window (first
    heartbeats, handshakes)."""
    alternations: int = 2
    """Windows per connector and size, interleaved with the other connector's."""
    resume_s: float = 1.0
    """Seconds a thawed pair steps before its window (its late heartbeats go out)."""
    lease_s: int = 30
    """``kv_lease_duration`` of both connectors (vLLM's default)."""


STEP_FULL = StepPlan(sizes=(0, 100, 1_000), window_s=6.0, settle_s=3.0)
STEP_QUICK = StepPlan(sizes=(0, 100, 1_000), window_s=2.0, settle_s=1.0, resume_s=0.5)


@dataclass(frozen=True, slots=True, kw_only=True)
class Window:
    """One connector's samples on one engine at one size."""

    samples: Sequence[Sample]
    """One per engine step in the window."""
    requests: int
    """Held (P) or queued (D) when the window closed, read from the scheduler."""
    wall_s: float
    """The window's wall time."""
    other_cpu_s: float
    """CPU seconds the engine process's threads other than the engine thread used in it."""


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
            "connector.cpu": [s[3] for s in w.samples],
            "engine_step.cpu": [s[4] for s in w.samples],
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
        fig("connector.cpu", "connector.cpu", 0.5, True),
        fig("scheduler", "scheduler", 0.5, False),
        fig("worker", "worker", 0.5, False),
        fig("engine_step", "engine_step", 0.5, False),
        fig("engine_step.cpu", "engine_step.cpu", 0.5, False),
        Figure(
            name=f"{base}.other_threads",
            size=n,
            value=ours.other_cpu_s / ours.wall_s if ours.wall_s else 0.0,
            unit="cores",
            anchor=ANCHOR,
            anchor_value=stock.other_cpu_s / stock.wall_s if stock.wall_s else 0.0,
            comparable=False,
        ),
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
    tails = (
        "connector",
        "connector.p99",
        "connector.cpu",
        "scheduler",
        "worker",
        "engine_step",
        "engine_step.cpu",
        "other_threads",
        "steps",
    )
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
            model=str(model),
            kv_transfer_config=kv,
            env=env,
            park=park,
            max_num_seqs=PREFILL_SEQS,
            cpus=tuple(int(c) for c in spec.cpus.split(",")),
        )

    return args(prefill, False), args(decode, True)


def window_order(plan: StepPlan) -> list[tuple[int, str]]:
    """(size, connector) of every window, in the order they are measured.

    At each size the connectors alternate (kvproto, stock, kvproto, stock, ...:
    ``plan.alternations`` windows each), so a load that comes and goes on the
    machine falls on both columns alike; the size after starts with the other
    connector, so neither is always measured first. Never two windows of one
    connector in a row (ABBA): a pair is frozen while the other is measured,
    and two windows frozen (~15 s) would near the 20 s a heartbeat extends a
    30 s lease by."""
    order = []
    for i, n in enumerate(plan.sizes):
        first = CONNECTORS if i % 2 == 0 else CONNECTORS[::-1]
        order += [(n, c) for _ in range(plan.alternations) for c in first]
    return order


def pooled(windows: Sequence[Window]) -> Window:
    """One cell from its alternations: every window's steps, the fewest requests any
    window closed with (a lease lost in one window shows), the windows' time summed."""
    return Window(
        samples=[s for w in windows for s in w.samples],
        requests=min(w.requests for w in windows),
        wall_s=sum(w.wall_s for w in windows),
        other_cpu_s=sum(w.other_cpu_s for w in windows),
    )


class _Pair:
    """One connector's P and D engine children."""

    def __init__(self, connector: str, model: Path, plan: StepPlan) -> None:
        p_args, d_args = _engine_args(pd_cpu("cluster"), model, connector, plan)
        self.connector = connector
        self.p = EngineChild(f"{connector}-P", p_args)
        self.d = EngineChild(f"{connector}-D", d_args)
        self.have = 0
        """Requests P holds and D has queued (the sizes so far)."""
        self.held = False
        """Frozen (:meth:`EngineChild.hold`) while the other pair is measured."""

    def start(self, say: Say) -> None:
        for engine in (self.p, self.d):
            info = engine.call("start")
            say(
                f"vllm-step: {engine.name} built with its engine thread on cores {info['built_on']}"
            )

    def grow(self, n: int, prompt: Callable[[int], str]) -> None:
        """Prefill on P and queue on D the requests from the last size up to ``n``."""
        ids = [f"{self.connector}-{i}" for i in range(self.have, n)]
        if ids:
            prompts = [prompt(i) for i in range(self.have, n)]
            params = self.p.call("prefill", request_ids=ids, prompts=prompts)
            self.d.call("park", request_ids=ids, prompts=prompts, params=params)
        self.have = n

    def hold(self) -> None:
        """Freeze both engines (the other pair is measured); a no-op if frozen."""
        if not self.held:
            self.d.hold()  # the reader first: it would heartbeat a frozen P
            self.p.hold()
            self.held = True

    def release(self) -> None:
        """Thaw both engines; a no-op if running."""
        if self.held:
            self.p.release()  # the holder first: it answers the reader's late heartbeats
            self.d.release()
            self.held = False

    def take(self) -> None:
        """Discard the samples so far (the window starts now)."""
        self.p.call("take")
        self.d.call("take")

    def stop(self) -> None:
        self.d.stop()  # the reader first: its heartbeats would only fail against a stopped P
        self.p.stop()


def _measure_pairs(
    pairs: Mapping[str, _Pair], plan: StepPlan, prompt: Callable[[int], str], say: Say
) -> dict[tuple[str, str, int], list[Window]]:
    out: dict[tuple[str, str, int], list[Window]] = {}
    size = None
    for n, connector in window_order(plan):
        if n != size:
            size = n
            for pair in pairs.values():  # both step while requests are added and settle
                pair.release()
                pair.grow(n, prompt)
            time.sleep(plan.settle_s)
        pair = pairs[connector]
        for other in pairs.values():
            if other is not pair:
                other.hold()
        pair.release()
        time.sleep(plan.resume_s)
        pair.take()
        before = {e.name: _other_cpu_s(e) for e in (pair.p, pair.d)}
        start = time.monotonic()
        time.sleep(plan.window_s)
        for role, engine in (("prefill", pair.p), ("decode", pair.d)):
            got = engine.call("take")
            wall = time.monotonic() - start
            others_s = _other_cpu_s(engine) - before[engine.name]
            state = engine.call("state")
            count = state["held"] if role == "prefill" else state["waiting"]
            window = Window(
                samples=got["samples"], requests=count, wall_s=wall, other_cpu_s=others_s
            )
            out.setdefault((connector, role, n), []).append(window)
            say(
                f"vllm-step: {connector:>7} {role:>7} N={n:<5,} {len(window.samples):>4} steps, "
                f"median {_us([s[0] + s[1] for s in window.samples], 0.5):.0f} us "
                f"(cpu {_us([s[3] for s in window.samples], 0.5):.0f} us), engine step "
                f"{_us([s[2] for s in window.samples], 0.5) / 1e3:.1f} ms "
                f"(cpu {_us([s[4] for s in window.samples], 0.5) / 1e3:.1f} ms), other threads "
                f"{others_s / wall:.2f} cores, {state}; "
                f"median per step: {_top_hooks(got['hook_median_ns'])}"
            )
    return out


def _other_cpu_s(engine: EngineChild) -> float:
    """CPU seconds so far of the engine process's threads but the engine thread (the
    child's main thread, whose thread id is the process id)."""
    pid = engine.proc.pid
    if pid is None:
        return 0.0
    return sum(cpu for tid, (_, cpu, _) in threads_of(pid).items() if tid != pid)


def _top_hooks(median_ns: Mapping[str, float]) -> str:
    """Every hook with a median of at least 1 us per step, largest first, in microseconds:
    the whole per-hook breakdown that the connector column sums (the rest is noise)."""
    top = sorted(((k, v) for k, v in median_ns.items() if v >= 1_000), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {ns / 1e3:.1f} us" for name, ns in top)


def measure(plan: StepPlan, say: Say) -> list[Figure]:
    """Both connectors' windows, interleaved (:func:`window_order`), then the figures
    (kvproto beside stock, each cell pooled from its alternations)."""
    tiny = pd_cpu("tiny_model")
    with tempfile.TemporaryDirectory(prefix="kvproto-vllm-step-") as tmp:
        model = tiny.build_tiny_llama(Path(tmp) / "model")

        def prompt(i: int) -> str:
            return f"step {i}: " + str(tiny.make_prompt(PROMPT_SENTENCES))

        pairs: dict[str, _Pair] = {}
        try:
            start = time.monotonic()
            for connector in CONNECTORS:  # all four children load at once
                pairs[connector] = _Pair(connector, model, plan)
            for pair in pairs.values():
                pair.start(say)
            say(f"vllm-step: both engine pairs up in {time.monotonic() - start:.0f} s")
            windows = _measure_pairs(pairs, plan, prompt, say)
        finally:
            for pair in pairs.values():
                pair.stop()
    cells = {key: pooled(ws) for key, ws in windows.items()}
    return step_figures(cells, plan.sizes)
