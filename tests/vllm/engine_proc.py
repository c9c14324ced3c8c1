"""Drive one real vLLM engine in a child process, for P/D tests.

Why a child process per engine: vLLM keeps the worker-side KV connector in a
module global (``kv_transfer_state._KV_CONNECTOR_AGENT``) and freezes env vars
after the first engine starts (``envs.enable_envs_cache``), so two engines in
one Python process would share one worker connector and one side-channel port.
Each child runs its engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so the scheduler, the worker and both connector instances live in that child
and can be inspected there.

Like vLLM's server loop (``EngineCore.run_busy_loop`` steps while
``scheduler.has_requests()``), the child keeps stepping its engine whenever it
is between commands and holds requests -- e.g. a prefill request whose blocks
wait for the decoder's read. Without that, P would never poll NIXL
notifications and never free anything.

Children are started with the ``spawn`` method and re-import this module as
``tests.vllm.engine_proc`` (spawn hands the parent's sys.path, which pytest
gave the repo root, to the child); it imports no vLLM at top level.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import resource
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from examples.pd_cpu.cluster import free_port

#: Seconds a command may take before the parent gives up on the child.
DEFAULT_TIMEOUT_S = 240.0


def free_port_pair() -> int:
    """A port p with p + 1 also free (rank r of a TP-2 holder listens on base + r), both
    outside the ephemeral range (:func:`examples.pd_cpu.cluster.free_port` says why)."""
    return free_port(2)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    """How to build one engine."""

    model: str
    """Directory of the (tiny) model checkpoint and tokenizer."""
    kv_transfer_config: dict[str, Any] | None
    """Passed as LLM(kv_transfer_config=...); None for a plain engine."""
    side_channel_port: int
    """VLLM_NIXL_SIDE_CHANNEL_PORT for this engine (each engine its own)."""
    prefix_caching: bool = True
    """enable_prefix_caching; P runs use False so a baseline run on P cannot
    turn the later prefill into a local prefix hit."""
    block_size: int = 32
    """KV block size; the CPU attention backend needs a multiple of 32."""
    max_model_len: int = 512
    """Small, so the 1 GiB CPU KV cache holds many blocks."""
    max_num_seqs: int = 8
    """Requests running at once; 1 makes a request queue behind another (overload)."""
    scheduling_policy: str = "fcfs"
    """"priority" lets a test keep a request queued by adding more urgent local work."""
    keep_kv_core_pinning: bool = False
    """Stock NixlConnector's worker pins the engine thread to the last core of
    each NUMA node on CPU (base_worker.py, os.sched_setaffinity); on a 2-core
    box two engines then share one core. False disables that (in-process)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """More env vars set in the child before vLLM is imported."""
    llm_args: dict[str, Any] = field(default_factory=dict)
    """More keyword arguments for ``LLM(...)`` (a model shape's own block size, say)."""
    tensor_parallel_size: int = 1
    """TP ranks; above 1 the engine core stays in the child but each rank is a
    worker process of vLLM's multiprocessing executor (so worker-side state is
    read with ``worker_states``), its OpenMP threads bound by
    ``VLLM_CPU_OMP_THREADS_BIND`` (see :func:`omp_bind`)."""


def _set_env(spec: EngineSpec) -> None:
    # vLLM's CPU platform writes its SSM conv-state layout choice into os.environ of the
    # process that builds a config ("SD" for a non-NIXL connector on an AVX512-BF16 CPU),
    # and tests that build configs in pytest's process pass it on to every engine forked
    # after them: stock NixlConnector's Mamba check then fails. Each engine chooses anew.
    os.environ.pop("VLLM_SSM_CONV_STATE_LAYOUT", None)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if spec.tensor_parallel_size > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind(spec.tensor_parallel_size)
    os.environ.update(spec.extra_env)


def omp_bind(tp_size: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving TP rank r the r-th CPU this process may use
    (wrapping round when there are fewer CPUs than ranks).

    vLLM's default ``auto`` binds one NUMA node per rank and refuses TP 2 on a
    single-node machine ("Not enough allowed NUMA nodes to bind threads of 2
    local CPUWorkers"); ``nobind`` would give every rank all cores' worth of
    OpenMP threads. An explicit list ``"0|1"`` runs TP 2 on two cores."""
    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(str(cpus[r % len(cpus)]) for r in range(tp_size))


def _disable_kv_core_pinning() -> None:
    from vllm.platforms.cpu import CpuPlatform

    # In-process only: the patched classmethod lives in this interpreter. The
    # worker then skips its os.sched_setaffinity (no NUMA core list).
    CpuPlatform.discover_numa_topology = classmethod(  # type: ignore[method-assign,assignment]
        lambda cls: []
    )


def _label_filter(key: str) -> tuple[str, dict[str, str]]:
    """``"name{a=b,c=d}"`` -> ``("name", {"a": "b", "c": "d"})``."""
    name, _, rest = key.partition("{")
    pairs = (item.split("=", 1) for item in rest.rstrip("}").split(",") if "=" in item)
    return name, {k.strip(): v.strip().strip('"') for k, v in pairs}


class _Server:
    """Runs in the child: owns the LLM and answers commands."""

    def __init__(self, spec: EngineSpec) -> None:
        from vllm import LLM

        if not spec.keep_kv_core_pinning:
            _disable_kv_core_pinning()
        t0 = time.perf_counter()
        self.llm = LLM(
            model=spec.model,
            tokenizer=spec.model,
            dtype="float32",
            enforce_eager=True,
            block_size=spec.block_size,
            max_model_len=spec.max_model_len,
            max_num_seqs=spec.max_num_seqs,
            scheduling_policy=spec.scheduling_policy,
            enable_prefix_caching=spec.prefix_caching,
            tensor_parallel_size=spec.tensor_parallel_size,
            kv_transfer_config=spec.kv_transfer_config,
            disable_log_stats=False,  # Prometheus metrics for get_metrics()
            seed=0,
            **spec.llm_args,
        )
        self.init_s = time.perf_counter() - t0
        client: Any = self.llm.llm_engine.engine_core  # InprocClient when in-process
        self.core = client.engine_core
        self.scheduler = self.core.scheduler
        self.outputs: dict[str, Any] = {}
        """Finished outputs of requests added with cmd_add, by request id."""
        self.steps = 0
        """Engine steps taken by pump/collect (not by generate)."""

    # -- commands (name -> method cmd_<name>) ---------------------------------
    def cmd_info(self) -> dict[str, Any]:
        # affinity shows whether the stock NIXL worker pinned the engine thread.
        pids: list[int] = self.llm.collective_rpc(_worker_pid)
        return {
            "init_s": self.init_s,
            "pid": os.getpid(),
            "affinity": sorted(os.sched_getaffinity(0)),
            "worker_pids": [pid for pid in pids if pid != os.getpid()],
        }

    def cmd_generate(
        self,
        prompts: list[str],
        sampling: dict[str, Any],
        kv_transfer_params: list[dict[str, Any] | None] | None = None,
    ) -> list[dict[str, Any]]:
        """Greedy-by-default generate; one kv_transfer_params per prompt."""
        from vllm import SamplingParams

        params = []
        for i in range(len(prompts)):
            kw = {"temperature": 0.0, "ignore_eos": True, **sampling}
            kvp = kv_transfer_params[i] if kv_transfer_params else None
            if kvp is not None:
                kw["extra_args"] = {"kv_transfer_params": kvp}
            params.append(SamplingParams(**kw))
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        return [
            {
                "token_ids": list(o.outputs[0].token_ids),
                "prompt_token_ids": list(o.prompt_token_ids or []),
                "kv_transfer_params": o.kv_transfer_params,
                "finish_reason": o.outputs[0].finish_reason,
                "generate_s": dt,
            }
            for o in outs
        ]

    def cmd_state(self) -> dict[str, Any]:
        s = self.scheduler
        running, waiting = s.get_request_counts()
        return {
            "requests": len(s.requests),
            "running": running,
            "waiting": waiting,
            "free_blocks": s.kv_cache_manager.block_pool.get_num_free_blocks(),
        }

    def cmd_metrics(self, names: list[str]) -> dict[str, float]:
        """Each metric's value summed over its label sets; ``name{label=value}`` keeps
        only the label sets that match (``vllm:prompt_tokens_by_source{source=...}``)."""
        out = dict.fromkeys(names, 0.0)
        wanted = [(key, *_label_filter(key)) for key in names]
        for m in self.llm.get_metrics():
            labels = getattr(m, "labels", None) or {}
            for key, name, match in wanted:
                if m.name == name and all(labels.get(k) == v for k, v in match.items()):
                    out[key] += float(getattr(m, "value", 0) or 0)
        return out

    def cmd_wait_idle(self, timeout_s: float) -> dict[str, Any]:
        """Step until the scheduler holds no request; report how long it took."""
        t0 = time.perf_counter()
        while self.scheduler.has_requests() and time.perf_counter() - t0 < timeout_s:
            self._step()
            time.sleep(0.002)
        return {"idle": not self.scheduler.has_requests(), "waited_s": time.perf_counter() - t0}

    def cmd_peak_rss_mib(self) -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0

    def cmd_add(
        self,
        *,
        request_ids: list[str],
        prompts: list[str],
        sampling: dict[str, Any],
        kv_transfer_params: list[dict[str, Any] | None] | None = None,
        abort_now: bool = False,
        priority: int = 0,
    ) -> None:
        """Enqueue requests without waiting (the loop steps them between commands).

        ``abort_now`` aborts them right after enqueueing, before any step: a
        client that gave up while its request was still queued."""
        from vllm import SamplingParams

        for i, (rid, prompt) in enumerate(zip(request_ids, prompts, strict=True)):
            kw = {"temperature": 0.0, "ignore_eos": True, **sampling}
            kvp = kv_transfer_params[i] if kv_transfer_params else None
            if kvp is not None:
                kw["extra_args"] = {"kv_transfer_params": kvp}
            self.llm.llm_engine.add_request(rid, prompt, SamplingParams(**kw), priority=priority)
        if abort_now:
            self.llm.llm_engine.abort_request(list(request_ids))

    def cmd_collect(self, request_ids: list[str], timeout_s: float) -> list[dict[str, Any]]:
        """Step until the requests added with cmd_add finished; their outputs."""
        t0 = time.perf_counter()
        while not all(r in self.outputs for r in request_ids):
            if time.perf_counter() - t0 > timeout_s:
                missing = [r for r in request_ids if r not in self.outputs]
                raise TimeoutError(f"requests {missing} unfinished after {timeout_s} s")
            self._step()
        return [_output_dict(self.outputs.pop(r), time.perf_counter() - t0) for r in request_ids]

    def cmd_abort(self, request_ids: list[str]) -> None:
        self.llm.llm_engine.abort_request(request_ids)

    def cmd_stall(self, seconds: float) -> None:
        """Block the engine thread, as a long forward pass would (no steps, no polling)."""
        time.sleep(seconds)

    def cmd_add_and_stall(self, stall_s: float, **add: Any) -> None:
        """Enqueue, then block the engine before its next step."""
        self.cmd_add(**add)
        time.sleep(stall_s)

    def cmd_steps(self) -> int:
        return self.steps

    def cmd_loaded(self, prefixes: list[str]) -> dict[str, list[str]]:
        """Loaded Python modules and mapped files of site-packages entries whose names start
        with a prefix (a UCX engine must never load NIXL: both bundle their own libucx)."""
        import sys

        modules = sorted(m for m in sys.modules if m.startswith(tuple(prefixes)))
        files: set[str] = set()
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                parts = path.split("/site-packages/", 1)
                if len(parts) == 2 and parts[1].startswith(tuple(prefixes)):
                    files.add(parts[1])
        return {"modules": modules, "files": sorted(files)}

    def cmd_connector_state(self) -> dict[str, Any]:
        """debug_state() of the scheduler- and worker-side connectors, when they have one."""
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            get_kv_transfer_group,
            has_kv_transfer_group,
        )

        out: dict[str, Any] = {}
        sched_conn = _with_debug_state(getattr(self.scheduler, "connector", None))
        if sched_conn is not None:
            out["scheduler"] = sched_conn.debug_state()
        if has_kv_transfer_group():
            worker_conn = _with_debug_state(get_kv_transfer_group())
            if worker_conn is not None:
                out["worker"] = worker_conn.debug_state()
        return out

    def cmd_worker_states(self) -> list[dict[str, Any]]:
        """debug_state() of the worker-side connector of every TP rank, rank order
        (through vLLM's collective_rpc: with TP > 1 the ranks are other processes)."""
        states: list[dict[str, Any]] = self.llm.collective_rpc(_worker_connector_state)
        return states

    def _step(self) -> None:
        for out in self.llm.llm_engine.step():
            if out.finished:
                self.outputs[out.request_id] = out
        self.steps += 1

    def shutdown_workers(self) -> None:
        """End the TP worker processes before the child exits. Left to interpreter
        exit, the multiprocessing executor's teardown outlived stop()'s 30 s join
        here (the child was then SIGKILLed); shut down explicitly it takes ~9 s
        (vLLM's 5 s grace, then SIGTERM)."""
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()

    def pump(self) -> None:
        """Between commands: step like the server loop would."""
        if self.scheduler.has_requests():
            self._step()


def _worker_pid(_worker: Any) -> int:
    """Runs in a worker (collective_rpc): its process id."""
    return os.getpid()


def _worker_connector_state(_worker: Any) -> dict[str, Any]:
    """Runs in a worker (collective_rpc): its connector's debug_state(), or {}."""
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    if not has_kv_transfer_group():
        return {}
    connector = _with_debug_state(get_kv_transfer_group())
    state: dict[str, Any] = connector.debug_state() if connector is not None else {}
    return state


def _with_debug_state(connector: Any) -> Any:
    """The connector itself, or under vLLM's MultiConnector its first child, that has
    debug_state() (KvprotoConnector); None when there is none."""
    if connector is None or hasattr(connector, "debug_state"):
        return connector
    for child in getattr(connector, "sub_connectors", ()):
        if hasattr(child, "debug_state"):
            return child
    return None


def _output_dict(o: Any, waited_s: float) -> dict[str, Any]:
    return {
        "token_ids": list(o.outputs[0].token_ids),
        "prompt_token_ids": list(o.prompt_token_ids or []),
        "kv_transfer_params": o.kv_transfer_params,
        "finish_reason": o.outputs[0].finish_reason,
        "generate_s": waited_s,
    }


def _child_main(conn: Any, spec: EngineSpec) -> None:
    _set_env(spec)
    try:
        server = _Server(spec)
        conn.send(("ok", server.cmd_info()))
    except BaseException as e:
        conn.send(("err", f"{e!r}\n{traceback.format_exc()}"))
        return
    while True:
        if not conn.poll(0.005):
            try:
                server.pump()
            except BaseException as e:  # surface at the next command
                conn.recv()
                conn.send(("err", f"pump: {e!r}\n{traceback.format_exc()}"))
                return
            continue
        name, kwargs = conn.recv()
        if name == "stop":
            if spec.tensor_parallel_size > 1:
                server.shutdown_workers()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(server, f"cmd_{name}")(**kwargs)))
        except BaseException as e:
            conn.send(("err", f"{name}: {e!r}\n{traceback.format_exc()}"))


class EngineProc:
    """Parent-side handle: start, call commands, stop or kill."""

    def __init__(self, spec: EngineSpec, *, name: str) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.spec = spec
        self._conn, child = ctx.Pipe()
        # A daemonic process may not start children, and TP > 1 starts one worker
        # process per rank; stop()/kill() end the child either way.
        daemon = spec.tensor_parallel_size == 1
        self.proc = ctx.Process(target=_child_main, args=(child, spec), name=name, daemon=daemon)
        self.proc.start()
        self.info: dict[str, Any] | None = None

    def wait_ready(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
        self.info = self._reply(timeout_s, "start")
        return self.info

    def call(self, name: str, /, *, rpc_timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> Any:
        """Run command ``name`` in the child with ``kwargs``; return its value."""
        self._conn.send((name, kwargs))
        return self._reply(rpc_timeout_s, name)

    def _reply(self, timeout_s: float, what: str) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"{self.name}: no answer to {what} in {timeout_s} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(
                f"{self.name}: engine process died during {what} (exit {self.proc.exitcode})"
            ) from None
        if status != "ok":
            raise RuntimeError(f"{self.name}: {value}")
        return value

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(TimeoutError, RuntimeError, OSError, EOFError):
                self.call("stop", rpc_timeout_s=timeout_s)
            self.proc.join(timeout_s)
        self.kill()

    def kill(self) -> None:
        """SIGKILL, as a crashed engine would look to its peer (TP worker processes too)."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        for pid in (self.info or {}).get("worker_pids", []):
            # The dead child's TP workers would notice only at their next poll of
            # its death pipe; a killed engine must not leave them behind.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def prefill(p: EngineProc, prompt: str) -> dict[str, Any]:
    """P's ``kv_transfer_params`` for ``prompt``: a one-token prefill for a remote decoder."""
    (pre,) = p.call(
        "generate",
        prompts=[prompt],
        sampling={"max_tokens": 1},
        kv_transfer_params=[{"do_remote_decode": True}],
    )
    params = pre["kv_transfer_params"]
    assert params is not None and params["do_remote_prefill"] is True
    assert "kvproto" in params  # a KvprotoConnector prefill engine's ticket
    return dict(params)
