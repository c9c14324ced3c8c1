"""One real vLLM engine in a child process, stepped like vLLM's busy loop, each step timed.

Why a child per engine: vLLM keeps the worker-side connector in a module global
and freezes its env vars once an engine starts, so P and D cannot share a
process. The engine runs in-process in the child (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so its scheduler, worker and both connector halves share the child's
:data:`~.step_timing.TOTALS`.

Between commands the child keeps stepping, back to back as
``EngineCore.run_busy_loop`` does while it has requests (it only checks its
input queue, without blocking, between steps), unless held
(:meth:`EngineChild.hold` until :meth:`EngineChild.release`: the suite keeps
two engine pairs alive and runs only the pair it measures). A *background*
request (a local decode, no KV transfer) always runs, replaced as soon as it
finishes, so the engine steps at every size, with a forward pass, like an
engine under load. On D (``park=True``: priority scheduling and
``max_num_seqs=1``) it also keeps the remote-prefill requests queued behind
it: tracked by the connector, never scheduled.

Every step is one sample: connector nanoseconds on the scheduler side and on
the worker side (read from the timed connector, :mod:`.step_timing`) and the
whole ``LLMEngine.step()``, each in wall time, and the engine thread's CPU
time in the connector and in the whole step.

Cores: the whole child runs on the cores its layout gives it (examples/pd_cpu:
P on the first core, D on the last), every thread. The layout's
``VLLM_CPU_OMP_THREADS_BIND`` is applied by vLLM's multiprocess executor only,
not by the in-process engine this driver needs, so the child pins itself: before
vLLM is imported (torch then sizes its OpenMP team to one core), and again after
the engine is built, because stock NixlConnector on a CPU platform pins the
thread that builds it to the last core of each NUMA node (vLLM's
``base_worker.py``, "reserve different cores for start_load_kv()"). In process
that thread is the engine thread, so both stock engines would share D's core,
and the NIXL threads it starts inherit that core: stock's steps then take
1.9-3.3x kvproto's (measured), for a reason that is not its hooks.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import signal
import statistics
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any

PAUSE_S = 0.0
"""Wait for a command between steps: none, as vLLM's busy loop (P and D each have
their own core, the layout's, to which the child pins itself). A pause would only let other
work evict the caches before the next step's hooks, in both columns."""
BACKGROUND_PROMPT = "Every token attends to all the tokens that came before it."
LEASE_ENDS = ("released_done", "expired", "peer_lost", "aborted", "revoked", "max_hold")
"""kvproto holder counters of leases ended, shown with P's state after each window."""
MAX_SAMPLES = 200_000
"""Steps kept between two reads (a cap, not a window: windows are read well before)."""

Sample = tuple[int, int, int, int, int]
"""One step: (scheduler-side connector ns, worker-side connector ns, whole step ns),
in wall time, then the engine thread's CPU ns in the connector (both sides) and in
the whole step."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineArgs:
    """How the child builds its engine (plain data: it crosses the process boundary)."""

    model: str
    """Model directory."""
    kv_transfer_config: dict[str, Any]
    """``LLM(kv_transfer_config=...)``: a timed connector (:mod:`.step_connectors`)."""
    env: dict[str, str]
    """Environment set before vLLM is imported (side-channel port, OpenMP binding, ...)."""
    park: bool
    """D: priority scheduling and one running request, so remote requests stay queued."""
    max_num_seqs: int
    """Running requests at once (P: room for a batch of prefills beside the background)."""
    cpus: tuple[int, ...]
    """Cores every thread of the child runs on (its examples/pd_cpu layout)."""
    max_model_len: int = 512
    """Small, so the 1 GiB CPU KV cache holds many requests."""


class _Engine:
    def __init__(self, args: EngineArgs) -> None:
        from kvproto_tools.bench.step_timing import TOTALS

        # Through importlib: this package type-checks where vLLM is not installed.
        self.vllm: Any = importlib.import_module("vllm")
        t0 = time.perf_counter()
        self.llm = self.vllm.LLM(
            model=args.model,
            tokenizer=args.model,
            dtype="float32",
            enforce_eager=True,
            block_size=32,
            max_model_len=args.max_model_len,
            max_num_seqs=1 if args.park else args.max_num_seqs,
            scheduling_policy="priority" if args.park else "fcfs",
            enable_prefix_caching=False,  # every prompt differs; P must hold, not hit
            kv_transfer_config=args.kv_transfer_config,
            seed=0,
        )
        self.init_s = time.perf_counter() - t0
        self.built_on = _pin(args.cpus)
        """The cores the engine thread was on once built, before the re-pin (stock's own)."""
        self.totals = TOTALS
        self.engine: Any = self.llm.llm_engine
        # InprocClient (VLLM_ENABLE_V1_MULTIPROCESSING=0): the engine core is in-process.
        self.scheduler = self.engine.engine_core.engine_core.scheduler
        self.max_model_len = args.max_model_len
        self.samples: deque[Sample] = deque(maxlen=MAX_SAMPLES)
        self.hook_ns: dict[str, list[int]] = {}
        """"side.hook" -> its ns in each step since the last take that called it."""
        self.finished: dict[str, Any] = {}
        self.stepping = True
        """Whether the child steps between commands (False from ``pause`` to ``resume``)."""
        self.background = 0
        self._add_background()

    def _params(self, max_tokens: int, kv: dict[str, Any] | None) -> Any:
        extra = None if kv is None else {"kv_transfer_params": kv}
        return self.vllm.SamplingParams(
            temperature=0.0, ignore_eos=True, max_tokens=max_tokens, extra_args=extra
        )

    def _add_background(self) -> None:
        self.background += 1
        self.engine.add_request(
            f"background-{self.background}",
            BACKGROUND_PROMPT,
            self._params(self.max_model_len - 64, None),
            priority=0,
        )

    def step(self) -> None:
        self.totals.take()  # what ran between steps (add_request's hooks) is not a step
        cpu_start = time.thread_time_ns()
        start = time.perf_counter_ns()
        outputs = self.engine.step()
        elapsed = time.perf_counter_ns() - start
        step_cpu = time.thread_time_ns() - cpu_start
        ns, cpu_ns, hooks = self.totals.take()
        for (side, hook), (_, hook_ns) in hooks.items():
            self.hook_ns.setdefault(f"{side}.{hook}", []).append(hook_ns)
        # max: the clock correction (step_timing) can overshoot a near-empty step a little.
        self.samples.append((ns["scheduler"], ns["worker"], elapsed, max(0, cpu_ns), step_cpu))
        for out in outputs:
            if not out.finished:
                continue
            if out.request_id.startswith("background-"):
                self._add_background()
            else:
                self.finished[out.request_id] = out

    # -- commands ----------------------------------------------------------------
    def cmd_prefill(self, request_ids: list[str], prompts: list[str]) -> list[dict[str, Any]]:
        """P: prefill for a remote decoder (one token); the kv_transfer_params D needs."""
        for rid, prompt in zip(request_ids, prompts, strict=True):
            self.engine.add_request(rid, prompt, self._params(1, {"do_remote_decode": True}))
        while not all(r in self.finished for r in request_ids):
            self.step()
        params = [self.finished.pop(r).kv_transfer_params for r in request_ids]
        if any(p is None for p in params):
            raise RuntimeError("a prefill returned no kv_transfer_params: P holds nothing")
        return params

    def cmd_park(
        self, request_ids: list[str], prompts: list[str], params: list[dict[str, Any]]
    ) -> None:
        """D: enqueue remote-prefill requests behind the background request."""
        for rid, prompt, kv in zip(request_ids, prompts, params, strict=True):
            self.engine.add_request(rid, prompt, self._params(16, kv), priority=1)

    def cmd_take(self) -> dict[str, Any]:
        """The samples since the last take, and each hook's median ns per step (0 in a
        step that did not call it): where the connector's time goes. Both reset."""
        samples, steps = list(self.samples), len(self.samples)
        hooks = {
            key: statistics.median([*ns, *[0] * (steps - len(ns))]) if steps else 0.0
            for key, ns in self.hook_ns.items()
        }
        self.samples.clear()
        self.hook_ns = {}
        return {"samples": samples, "hook_median_ns": hooks}

    def cmd_pause(self) -> None:
        """Stop stepping until ``resume``: the connector sees no hook meanwhile."""
        self.stepping = False

    def cmd_resume(self) -> None:
        """Step between commands again."""
        self.stepping = True

    def cmd_state(self) -> dict[str, int]:
        """Requests running, queued, and finished but held for a reader (P's leases);
        on kvproto's holder also how its leases have ended so far (a lease lost in a
        window says how)."""
        running, waiting = self.scheduler.get_request_counts()
        held = len(self.scheduler.requests) - running - waiting
        state = {"running": running, "waiting": waiting, "held": held}
        kv = importlib.import_module("vllm.distributed.kv_transfer.kv_transfer_state")
        worker = getattr(kv.get_kv_transfer_group(), "_worker", None)  # kvproto's WorkerSide
        if worker is not None and worker.holder_worker is not None:
            counts = worker.stats_snapshot()
            state.update((k, counts.get(f"holder_{k}", 0)) for k in LEASE_ENDS)
        return state


def _pin(cpus: tuple[int, ...]) -> str:
    """Every thread of this process onto ``cpus``; the cores the calling thread had."""
    had = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(task), cpus)
    return had


def _child(conn: Any, args: EngineArgs) -> None:
    os.environ.update(args.env)
    _pin(args.cpus)
    try:
        engine = _Engine(args)
        conn.send(
            ("ok", {"init_s": engine.init_s, "pid": os.getpid(), "built_on": engine.built_on})
        )
    except BaseException as exc:
        conn.send(("err", f"{exc!r}\n{traceback.format_exc()}"))
        return
    while True:
        try:
            if not conn.poll(PAUSE_S if engine.stepping else None):
                engine.step()
                continue
            name, kwargs = conn.recv()
            if name == "stop":
                conn.send(("ok", None))
                return
            conn.send(("ok", getattr(engine, f"cmd_{name}")(**kwargs)))
        except BaseException as exc:
            with contextlib.suppress(OSError):
                conn.send(("err", f"{exc!r}\n{traceback.format_exc()}"))
            return


class EngineChild:
    """Parent-side handle of one engine child: start, call a command, stop."""

    def __init__(self, name: str, args: EngineArgs) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self._conn, child_end = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child_end, args), name=name, daemon=True)
        self.proc.start()

    def call(self, name: str, /, *, timeout_s: float = 300.0, **kwargs: Any) -> Any:
        """Run ``cmd_<name>(**kwargs)`` in the child (``start`` waits for the engine)."""
        if name != "start":
            self._conn.send((name, kwargs))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"{self.name}: no answer to {name} in {timeout_s:.0f} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"{self.name}: engine died ({self.proc.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"{self.name}: {value}")
        return value

    def hold(self) -> None:
        """Stop stepping, then freeze the whole process: stock NixlConnector's progress
        thread would otherwise keep a core busy while its engine holds still."""
        self.call("pause")
        self._signal(signal.SIGSTOP)

    def release(self) -> None:
        """Thaw the process and step again."""
        self._signal(signal.SIGCONT)
        self.call("resume")

    def stop(self) -> None:
        """Ask the child to end (thawed first, if held); kill it if it does not within 30 s."""
        if self.proc.is_alive():
            self._signal(signal.SIGCONT)
            with contextlib.suppress(TimeoutError, RuntimeError, OSError):
                self.call("stop", timeout_s=30.0)
            self.proc.join(30.0)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()

    def _signal(self, sig: signal.Signals) -> None:
        pid = self.proc.pid
        if pid is not None:  # started (the constructor starts it)
            with contextlib.suppress(ProcessLookupError):  # it died: the next call says so
                os.kill(pid, sig)
