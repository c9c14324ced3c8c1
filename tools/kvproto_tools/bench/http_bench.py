"""``--suite http``: HTTP load through vllm-router, KvprotoConnector beside stock NixlConnector.

Each round starts the deployment of examples/pd_cpu once per variant
(alternating, so machine noise falls on all of them alike), sends the same
streamed completions workload through the router, and compares every answer
with a plain ``vllm serve`` (greedy). Per variant: TTFT and end-to-end
p50/p99, time per request (the inverse of throughput), errors, answers equal
to the baseline, and where the engines' CPU time went, thread by thread
(``/proc/<pid>/task``): name, CPU seconds over the workload, the cores it may
run on. The thread table is the evidence for the gap (spec/benchmarks.md §HTTP).

Variants: ``kvproto``; ``stock`` (NixlConnector at its defaults: NIXL's
progress thread on, ``num_threads`` 4); ``stock-1t`` (``num_threads`` 1, the
one knob stock offers for its UCX threads).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvproto_tools.bench.engine_suites import pd_cpu, threads_of
from kvproto_tools.bench.figures import Figure
from kvproto_tools.bench.timing import percentile

Say = Callable[[str], None]

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "kvproto": ("kvproto", {}),
    "stock": ("stock", {}),
    "stock-1t": ("stock", {"num_threads": 1}),
}
"""Variant -> (connector of examples/pd_cpu, extra ``kv_connector_extra_config``)."""
MAX_TOKENS = 16
LATENCIES = ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99")


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpPlan:
    """The workload of one ``http`` run."""

    requests: int = 64
    """Completions per variant and round."""
    concurrency: int = 8
    """Requests in flight at once."""
    rounds: int = 2
    """Deployments per variant (alternating variants)."""
    variants: tuple[str, ...] = tuple(VARIANTS)
    """Which variants; ``kvproto`` is compared with each other one."""


HTTP_QUICK = HttpPlan(requests=16, concurrency=4, rounds=1, variants=("kvproto", "stock"))


def check(plan: HttpPlan) -> str | None:
    """Why ``plan`` cannot run (a message for the user), or None."""
    unknown = [v for v in plan.variants if v not in VARIANTS]
    if unknown or "kvproto" not in plan.variants:
        got = ", ".join(plan.variants) or "none"
        return f"--variants: kvproto and any of {', '.join(VARIANTS)} (got {got})"
    if plan.requests < 1 or plan.rounds < 1 or plan.concurrency < 1:
        return "--requests, --rounds and --concurrency must be >= 1"
    return None


def _threads(proc: Any) -> dict[tuple[int, str], tuple[float, str]]:
    """(pid, thread name) -> (CPU seconds so far, allowed cores) for every thread of the tree."""
    return {
        (pid, f"{name}#{tid}"): (cpu_s, allowed)
        for pid in proc.tree()
        for tid, (name, cpu_s, allowed) in threads_of(pid).items()
    }


def _cpu_table(before: dict[Any, Any], after: dict[Any, Any], wall: float) -> list[dict[str, Any]]:
    rows = []
    for key, (cpu, allowed) in after.items():
        used = cpu - before.get(key, (0.0, ""))[0]
        if used >= 0.05 * wall:
            rows.append(
                {
                    "thread": key[1].split("#")[0],
                    "cpu_s": round(used, 2),
                    "share": round(used / wall, 2),
                    "cores": allowed,
                }
            )
    return sorted(rows, key=lambda r: -r["cpu_s"])


def run_variant(
    name: str,
    *,
    model: Any,
    workdir: Path,
    prompts: list[str],
    want: dict[str, Any],
    concurrency: int,
) -> dict[str, Any]:
    """One deployment of ``name``: the workload's latencies, errors and thread table."""
    cluster, client, tiny = pd_cpu("cluster"), pd_cpu("client"), pd_cpu("tiny_model")
    connector, extra = VARIANTS[name]
    prefills, decode = cluster.default_layout(1, base_port=None)
    dep = cluster.Deployment(
        model,
        workdir / name,
        connector=connector,
        prefills=prefills,
        decode=decode,
        router_port=cluster.free_port(),
        router_metrics_port=cluster.free_port(),
        connector_extra=extra,
    )
    (workdir / name).mkdir(parents=True, exist_ok=True)
    try:
        dep.start()
        client.complete(dep.router_url, str(model.path), tiny.make_prompt(2), max_tokens=4)
        procs = [dep.procs["prefill-0"], dep.procs["decode-0"]]
        t_before = [_threads(pr) for pr in procs]
        t0 = time.monotonic()

        def one(prompt: str) -> Any:
            try:
                return client.complete(
                    dep.router_url, str(model.path), prompt, max_tokens=MAX_TOKENS, stream=True
                )
            except client.RequestFailed as exc:
                return exc

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            answers = list(pool.map(one, prompts))
        wall = time.monotonic() - t0
        t_after = [_threads(pr) for pr in procs]
    finally:
        dep.stop()
    ok = [a for a in answers if isinstance(a, client.Answer)]
    equal = sum(
        1
        for pr, a in zip(prompts, answers, strict=True)
        if isinstance(a, client.Answer) and a.text == want[pr].text
    )
    return {
        "variant": name,
        "requests": len(prompts),
        "errors": len(prompts) - len(ok),
        "equal_to_baseline": equal,
        "wall_s": wall,
        "per_request": wall / max(1, len(ok)),
        "ttft_p50": percentile([a.ttft_s for a in ok], 0.5),
        "ttft_p99": percentile([a.ttft_s for a in ok], 0.99),
        "e2e_p50": percentile([a.total_s for a in ok], 0.5),
        "e2e_p99": percentile([a.total_s for a in ok], 0.99),
        "threads": {
            role: _cpu_table(b, a, wall)
            for role, b, a in zip(("prefill", "decode"), t_before, t_after, strict=True)
        },
    }


def http_figures(results: Sequence[dict[str, Any]]) -> list[Figure]:
    """kvproto beside every other variant: medians over rounds, in ms; counts summed."""
    variants = list(dict.fromkeys(r["variant"] for r in results))

    def med(variant: str, key: str) -> float:
        return float(statistics.median(r[key] for r in results if r["variant"] == variant))

    def total(variant: str, key: str) -> float:
        return float(sum(r[key] for r in results if r["variant"] == variant))

    figures: list[Figure] = []
    for other in (v for v in variants if v != "kvproto"):
        anchor = f"{other} NixlConnector" if other == "stock" else f"{other} (stock, num_threads 1)"
        for key in ("per_request", *LATENCIES):
            figures.append(
                Figure(
                    name=f"http.{key}.vs_{other}",
                    size=None,
                    value=med("kvproto", key) * 1e3,
                    unit="ms",
                    anchor=anchor,
                    anchor_value=med(other, key) * 1e3,
                )
            )
        for key in ("errors", "equal_to_baseline"):
            figures.append(
                Figure(
                    name=f"http.{key}.vs_{other}",
                    size=int(total("kvproto", "requests")),
                    value=total("kvproto", key),
                    unit="requests",
                    anchor=anchor,
                    anchor_value=total(other, key),
                    comparable=False,
                )
            )
    return figures


def _say_threads(results: Sequence[dict[str, Any]], say: Say) -> None:
    last = max(r["round"] for r in results)
    say("http: threads using >= 5% of the wall time (last round): cpu_s share [cores]")
    for r in (r for r in results if r["round"] == last):
        for role, rows in r["threads"].items():
            shown = "; ".join(
                f"{t['thread']} {t['cpu_s']} {t['share']} [{t['cores']}]" for t in rows
            )
            say(f"http:   {r['variant']:9} {role:8} {shown}")


def measure(plan: HttpPlan, say: Say) -> list[Figure]:
    """Baseline answers from a plain engine, then every variant, ``plan.rounds`` times."""
    cluster, client, tiny = pd_cpu("cluster"), pd_cpu("client"), pd_cpu("tiny_model")
    workdir = Path(tempfile.mkdtemp(prefix="kvproto-bench-http-"))
    model = cluster.ModelSpec(path=tiny.build_tiny_llama(workdir / "model"))
    prompts = [f"load {i}: " + tiny.make_prompt(3 + i % 5) for i in range(plan.requests)]
    base_spec = cluster.baseline_spec()
    with cluster.plain_engine(model, workdir, base_spec):
        want = {
            p: client.complete(base_spec.url, str(model.path), p, max_tokens=MAX_TOKENS)
            for p in prompts
        }
    results: list[dict[str, Any]] = []
    for r in range(plan.rounds):
        for name in plan.variants:
            res = run_variant(
                name,
                model=model,
                workdir=workdir / f"round{r}",
                prompts=prompts,
                want=want,
                concurrency=plan.concurrency,
            )
            res["round"] = r
            results.append(res)
            say(
                f"http: round {r} {name:9} {res['requests']} requests in {res['wall_s']:.1f} s, "
                f"errors {res['errors']}, equal to baseline {res['equal_to_baseline']}, "
                f"TTFT p50 {res['ttft_p50']:.3f} s p99 {res['ttft_p99']:.3f} s"
            )
    _say_threads(results, say)
    return http_figures(results)
