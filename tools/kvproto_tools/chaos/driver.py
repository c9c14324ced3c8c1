"""One chaos run on the real deployment: hosts, engines, load, faults, samples, baseline.

Two prefill engines and one decoder (``vllm serve``, KvprotoConnector over
NIXL on UCX's TCP transport) and vllm-router run on hosts made of network
namespaces (:mod:`.lan`): the prefill engines share the first core, the
decoder has the last to itself (examples/pd_cpu's layout: a decoder sharing a
core with a prefill engine stalls while that engine computes prompts). The
run sends the plan's load through the router from the hub host, applies the
plan's faults one after another while time is left, samples every engine
every ``sample_s``, waits for the leases to settle when the load ends, stops
everything, and asks a plain engine for the baseline answers. Every process
tree is killed and every namespace deleted on the way out, also on Ctrl-C and
on failure.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec

from kvproto_tools.bench.engine_suites import pd_cpu
from kvproto_tools.chaos import baseline
from kvproto_tools.chaos.bounds import PLANNING_TERMS, orphan_s, settle_s
from kvproto_tools.chaos.history import History, Sent
from kvproto_tools.chaos.inject import Injector
from kvproto_tools.chaos.lan import BACK, Lan
from kvproto_tools.chaos.load import Load
from kvproto_tools.chaos.monitor import Monitor
from kvproto_tools.chaos.schedule import (
    DECODE,
    FAULT_KINDS,
    HOST_OF,
    PREFILLS,
    Fault,
    Plan,
    make_schedule,
)
from kvproto_tools.netns import inside, remove_stale, transport_env

ENGINE_PORT, SIDE_CHANNEL_PORT = 8100, 5600
"""Every engine's HTTP and side-channel ports (each host has its own namespace)."""
ROUTER_PORT, ROUTER_METRICS_PORT = 8000, 29000
KILLS_UNTIL = 0.5
"""Kills start only in the first half of the load: each engine's last incarnation then
serves long enough for its memory to be judged over a steady stretch (checker: the second
half of its serving time, at least 5 minutes, so in runs of 20 minutes or more)."""
MAX_MODEL_LEN = 1024
"""The engines' context (the tiny Llama's prompts and answers fit in it)."""
HISTORY_FILE, BASELINE_FILE = "history.json", "baseline.json"
"""What a run leaves in its output folder for the checker (besides the report and plot)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """What ``kvproto chaos`` was asked to run."""

    seed: int
    """The schedule's seed."""
    duration_s: float
    """Seconds of load."""
    out: Path
    """Where the history, logs, report and plot go."""
    rate: float = 1.5
    """Steady requests per second (bursts come on top)."""
    lease_s: int = 10
    """``kv_lease_duration`` (i = d // 6, e = 2d // 3): faults play out in seconds."""
    warmup_s: float = 20.0
    """Seconds of load before the first fault."""
    sample_s: float = 0.25
    """Seconds between two metrics samples."""
    fault_kinds: tuple[str, ...] = FAULT_KINDS
    """The kinds of fault the schedule draws from."""

    def plan(self, sentences: tuple[str, ...]) -> Plan:
        """The schedule these options draw, prompts made of ``sentences``."""
        return make_schedule(
            self.seed,
            self.duration_s,
            sentences=sentences,
            lease_s=self.lease_s,
            rate=self.rate,
            warmup_s=self.warmup_s,
            fault_kinds=self.fault_kinds,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """What a run leaves for the checker."""

    history: History
    """Everything recorded."""
    expected: dict[str, baseline.Expected]
    """The plain engine's answers, by :func:`baseline.key_of`."""


def run(options: Options, say: Callable[[str], None]) -> Outcome:
    """Run the chaos run of ``options``; ``say`` gets a line per stage."""
    cluster, client, tiny = pd_cpu("cluster"), pd_cpu("client"), pd_cpu("tiny_model")
    work = options.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "tiny-llama"
    if not (model_dir / "config.json").is_file():
        tiny.build_tiny_llama(model_dir)
    model = cluster.ModelSpec(path=model_dir.resolve(), max_model_len=MAX_MODEL_LEN)
    plan = options.plan(tuple(tiny.CORPUS))
    history = History(
        plan=plan,
        rate=options.rate,
        warmup_s=options.warmup_s,
        sample_s=options.sample_s,
        layout="prefill-0 and prefill-1 on the first core, decode-0 on the last",
    )
    remove_stale()
    with Lan([HOST_OF[name] for name in (*PREFILLS, DECODE)]) as lan, inside(lan.hub.netns):
        dep = _deployment(cluster, model, work, lan, options.lease_s)
        say(f"starting {', '.join(HOST_OF)} and the router in namespaces (logs in {work})")
        dep.start()
        try:
            history.startup_s = dict(dep.startup_s)
            say("healthy: " + ", ".join(f"{k} {v:.0f} s" for k, v in dep.startup_s.items()))
            _Run(
                options, cluster=cluster, client=client, dep=dep, lan=lan, history=history, say=say
            ).drive()
        finally:
            dep.stop()
            history.save(options.out / HISTORY_FILE)
        answered = [history.request(s.index) for s in history.sent if s.outcome == "ok"]
        say(f"baseline: a plain engine answers the {len(answered)} answered requests")
        spec = cluster.baseline_spec()
        with cluster.plain_engine(model, work, spec, wrap=lan.hub.wrap):
            expected = baseline.answers(client, spec.url, str(model.path), answered)
    (options.out / BASELINE_FILE).write_bytes(msgspec.json.encode(expected))
    return Outcome(history=history, expected=expected)


def load(out: Path) -> Outcome:
    """A run saved in ``out`` (what :func:`run` wrote there)."""
    expected = msgspec.json.decode(
        (out / BASELINE_FILE).read_bytes(), type=dict[str, baseline.Expected]
    )
    return Outcome(history=History.load(out / HISTORY_FILE), expected=expected)


def _deployment(cluster: ModuleType, model: Any, work: Path, lan: Lan, lease_s: int) -> Any:
    prefills, decode = cluster.default_layout(len(PREFILLS), base_port=None)

    def placed(spec: Any) -> Any:
        host = lan.hosts[HOST_OF[spec.name]]
        return dataclasses.replace(
            spec,
            host=host.front,
            side_channel_host=lan.back_of(host.name),
            port=ENGINE_PORT,
            side_channel_port=SIDE_CHANNEL_PORT,
        )

    wrap = {name: lan.hosts[host].wrap for name, host in HOST_OF.items()}
    return cluster.Deployment(
        model,
        work,
        prefills=[placed(s) for s in prefills],
        decode=placed(decode),
        router_port=ROUTER_PORT,
        router_metrics_port=ROUTER_METRICS_PORT,
        lease_s=lease_s,
        # NIXL's UCX over TCP on the fabric interface only: shared memory would cross
        # the namespaces and bypass the faults.
        # PYTHONFAULTHANDLER: a worker that dies of a signal (a native crash in a transport
        # library, say) prints every thread's Python stack to its log; without it a
        # prefill worker once vanished mid-run with nothing in its log.
        # ONEDNN_PRIMITIVE_CACHE_CAPACITY=0: vLLM's CPU linear layers build a oneDNN
        # primitive per batch shape and keep the last 32 per layer themselves; oneDNN's
        # own cache (1,024 by default) keeps evicted ones too, and filling it takes a
        # prefill engine about half an hour of this load: growth the memory judge
        # would charge to kvproto. Off, a plain engine's heap is flat after a few
        # hundred prefills (spec/chaos.md, "Memory of a plain engine").
        extra_env={
            **transport_env(BACK),
            "PYTHONFAULTHANDLER": "1",
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
        },
        router_extra=["--prefill-policy", "round_robin"],
        wrap={**wrap, "router": lan.hub.wrap},
    )


class _Run:
    """The load, the faults and the samples of one run, until the leases settle after it."""

    def __init__(
        self,
        options: Options,
        *,
        cluster: ModuleType,
        client: ModuleType,
        dep: Any,
        lan: Lan,
        history: History,
        say: Callable[[str], None],
    ) -> None:
        self.options = options
        self.history = history
        self.say = say
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self.stop = threading.Event()
        """Set when the load ends: no further fault starts."""
        incarnation = dict.fromkeys(HOST_OF, 1)
        scheduled: set[str] = set()
        self.monitor = Monitor(
            client=client,
            deployment=dep,
            history=history,
            clock=self.clock,
            incarnation=incarnation,
            scheduled=scheduled,
        )
        self.injector = Injector(
            lan=lan,
            deployment=dep,
            clock=self.clock,
            incarnation=incarnation,
            scheduled=scheduled,
            start_error=cluster.DeploymentError,
            wait_healthy=cluster.wait_healthy,
            stopping=self.stop,
        )
        self.load = Load(client, dep.router_url, str(dep.model.path), self.clock, self.record)
        self.restart_s = max(dep.startup_s.get(n, 0.0) for n in HOST_OF)
        """How long a restart may take (the engines' start, all at once, is the slowest)."""

    def clock(self) -> float:
        """Seconds since the run began."""
        return time.monotonic() - self._started

    def record(self, sent: Sent) -> None:
        """A request ended."""
        with self._lock:
            self.history.sent.append(sent)

    def drive(self) -> None:
        """Load, faults and samples; then wait for the last answers and the leases."""
        history, options = self.history, self.options
        faults = threading.Thread(target=self.fault_loop, name="chaos-faults", daemon=True)
        self.monitor.start()
        faults.start()
        try:
            self.say(f"load: {len(history.plan.requests)} requests over {options.duration_s:.0f} s")
            history.load_end = self.load.run(history.plan.requests)
            self.stop.set()
            faults.join()
            left = self.load.wait(timeout_s=120.0)
            self.say(f"load done at {self.clock():.0f} s; {left} request(s) open after 120 s")
            self.settle(orphan_s(options.lease_s, PLANNING_TERMS))
            history.end = self.clock()
        finally:
            self.stop.set()
            self.load.stopped.set()
            # A restart under way ends with it (the deployment's stop kills what it started).
            faults.join(timeout=5.0)
            self.monitor.stop()

    def fault_loop(self) -> None:
        """Apply the plan's faults in order, each whose window still fits before the load ends."""
        options, history, say = self.options, self.history, self.say
        if self.stop.wait(options.warmup_s):
            return
        for fault in history.plan.faults:
            settle = settle_s(fault, options.lease_s, PLANNING_TERMS)
            needed = fault.gap_s + fault.length_s + settle
            if fault.kind.startswith("kill"):
                needed += self.restart_s
            if self.clock() + needed > options.duration_s:
                continue  # a later, shorter fault may still fit
            if fault.kind.startswith("kill") and self.clock() > KILLS_UNTIL * options.duration_s:
                continue
            if self.stop.wait(fault.gap_s):
                return
            for name in self.injector.restart_crashed():
                say(f"{name} had died unscheduled: restarted")
            say(f"{self.clock():6.1f} s  fault {fault.index}: {_describe(fault)}")
            done = self.injector.apply(fault)
            history.injected.append(done)
            if not done.restarted:
                say(f"  restart failed: {done.detail[:200]}")
            if self.stop.wait(settle):
                return

    def settle(self, bound_s: float) -> None:
        """Wait (bounded) until no engine holds or tracks a lease, as a sample that began
        after the load's last answer shows: one begun earlier may still be scraping an
        engine that serves the last request (its lease counted in the run's last sample,
        the one the end state is judged on, after the run had called itself settled)."""
        history = self.history
        since = self.clock()
        deadline = since + bound_s
        while self.clock() < deadline:
            last = history.samples[-1] if history.samples else None
            if (
                last is not None
                and last.t0 >= since
                and all(
                    e.metrics is not None
                    and e.metrics.get("vllm:kvproto_holder_leases_held", 0.0) == 0
                    and e.metrics.get("vllm:kvproto_holder_leases_granted", 0.0) == 0
                    and e.metrics.get("vllm:kvproto_reader_requests", 0.0) == 0
                    for e in last.engines
                )
            ):
                return
            time.sleep(history.sample_s)


def _describe(fault: Fault) -> str:
    what = " <-> ".join(fault.target)
    if fault.kind == "loss":
        return f"loss {fault.loss:.0%} {what} for {fault.length_s:.1f} s"
    if fault.kind == "flap":
        return f"flap {what} x{fault.flaps} (down {fault.down_s:.1f} s, up {fault.up_s:.1f} s)"
    if fault.kind == "partition":
        return f"partition {what} for {fault.length_s:.1f} s"
    return f"kill -9 {what}, restart after {fault.length_s:.1f} s"
