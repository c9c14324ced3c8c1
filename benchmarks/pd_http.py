"""HTTP load through vllm-router: KvprotoConnector vs stock NixlConnector, in one run.

    python benchmarks/pd_http.py                       # 64 requests, concurrency 8, 2 rounds
    python benchmarks/pd_http.py --requests 32 --rounds 1 --json out/pd-http.json

Each round starts the deployment of examples/pd_cpu once per variant
(alternating, so machine noise falls on all of them alike), sends the same
streamed completions workload through the router, and compares every answer
with a plain ``vllm serve`` (greedy). Per variant: throughput, TTFT and
end-to-end p50/p99, errors, answers equal to the baseline, and where the
engines' CPU time went, thread by thread (``/proc/<pid>/task``): name, CPU
seconds over the workload, the cores it may run on. The thread table is the
evidence for the gap (spec/benchmarks.md §HTTP).

Variants: ``kvproto``; ``stock`` (NixlConnector at its defaults: NIXL's
progress thread on, ``num_threads`` 4); ``stock-1t`` (``num_threads`` 1, the
one knob stock offers for its UCX threads).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.pd_cpu.client import Answer, RequestFailed, complete
from examples.pd_cpu.cluster import (
    Deployment,
    ModelSpec,
    Proc,
    baseline_spec,
    default_layout,
    free_port,
    plain_engine,
)
from examples.pd_cpu.tiny_model import build_tiny_llama, make_prompt

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "kvproto": ("kvproto", {}),
    "stock": ("stock", {}),
    "stock-1t": ("stock", {"num_threads": 1}),
}
MAX_TOKENS = 16


def _threads(proc: Proc) -> dict[tuple[int, str], tuple[float, str]]:
    """(pid, thread name) -> (CPU seconds so far, allowed cores) for every thread of the tree."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[tuple[int, str], tuple[float, str]] = {}
    for pid in proc.tree():
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
                status = (task / "status").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            cpu_s = (int(fields[11]) + int(fields[12])) / tick
            allowed = next(
                (
                    ln.split(":", 1)[1].strip()
                    for ln in status.splitlines()
                    if ln.startswith("Cpus_allowed_list")
                ),
                "?",
            )
            key = (pid, f"{name}#{task.name}")
            out[key] = (cpu_s, allowed)
    return out


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


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_variant(
    name: str,
    *,
    model: ModelSpec,
    workdir: Path,
    prompts: list[str],
    want: dict[str, Answer],
    concurrency: int,
) -> dict[str, Any]:
    connector, extra = VARIANTS[name]
    prefills, decode = default_layout(1, base_port=None)
    dep = Deployment(
        model,
        workdir / name,
        connector=connector,
        prefills=prefills,
        decode=decode,
        router_port=free_port(),
        router_metrics_port=free_port(),
        connector_extra=extra,
    )
    (workdir / name).mkdir(parents=True, exist_ok=True)
    try:
        dep.start()
        complete(dep.router_url, str(model.path), make_prompt(2), max_tokens=4)  # warm-up
        procs = [dep.procs["prefill-0"], dep.procs["decode-0"]]
        t_before = [_threads(pr) for pr in procs]
        t0 = time.monotonic()

        def one(prompt: str) -> Answer | RequestFailed:
            try:
                return complete(
                    dep.router_url, str(model.path), prompt, max_tokens=MAX_TOKENS, stream=True
                )
            except RequestFailed as exc:
                return exc

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            answers = list(pool.map(one, prompts))
        wall = time.monotonic() - t0
        t_after = [_threads(pr) for pr in procs]
    finally:
        dep.stop()
    ok = [a for a in answers if isinstance(a, Answer)]
    equal = sum(
        1
        for pr, a in zip(prompts, answers, strict=True)
        if isinstance(a, Answer) and a.text == want[pr].text
    )
    return {
        "variant": name,
        "requests": len(prompts),
        "errors": len(prompts) - len(ok),
        "equal_to_baseline": equal,
        "wall_s": round(wall, 2),
        "req_per_s": round(len(ok) / wall, 2),
        "ttft_p50_s": round(_pct([a.ttft_s for a in ok], 0.5), 3),
        "ttft_p99_s": round(_pct([a.ttft_s for a in ok], 0.99), 3),
        "e2e_p50_s": round(_pct([a.total_s for a in ok], 0.5), 3),
        "e2e_p99_s": round(_pct([a.total_s for a in ok], 0.99), 3),
        "threads": {
            role: _cpu_table(b, a, wall)
            for role, b, a in zip(("prefill", "decode"), t_before, t_after, strict=True)
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default="kvproto,stock,stock-1t")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants or args.requests < 1 or args.rounds < 1:
        print(f"error: variants from {', '.join(VARIANTS)}; requests, rounds >= 1", file=sys.stderr)
        return 2
    if args.json is not None and not args.json.parent.is_dir():
        print(f"error: {args.json.parent} is not a directory", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="kvproto-pd-http-"))
    model = ModelSpec(path=build_tiny_llama(workdir / "model"))
    prompts = [f"load {i}: " + make_prompt(3 + i % 5) for i in range(args.requests)]
    base_spec = baseline_spec()
    with plain_engine(model, workdir, base_spec):
        want = {
            p: complete(base_spec.url, str(model.path), p, max_tokens=MAX_TOKENS) for p in prompts
        }
    results: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for name in variants:
            res = run_variant(
                name,
                model=model,
                workdir=workdir / f"round{r}",
                prompts=prompts,
                want=want,
                concurrency=args.concurrency,
            )
            res["round"] = r
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if k != "threads"}), flush=True)
    _print(results, variants)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return 0


def _print(results: list[dict[str, Any]], variants: list[str]) -> None:
    keys = ("req_per_s", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s")
    med = {
        v: {k: statistics.median(r[k] for r in results if r["variant"] == v) for k in keys}
        for v in variants
    }
    print("\nmedians over rounds (ratio: kvproto better when > 1)")
    print(f"{'variant':10} " + " ".join(f"{k:>11}" for k in keys) + "  errors  equal")
    for v in variants:
        rs = [r for r in results if r["variant"] == v]
        print(
            f"{v:10} "
            + " ".join(f"{med[v][k]:>11}" for k in keys)
            + f"  {sum(r['errors'] for r in rs):>6}  {sum(r['equal_to_baseline'] for r in rs):>5}"
            + f"/{sum(r['requests'] for r in rs)}"
        )
    if "kvproto" in med:
        for v in variants:
            if v == "kvproto":
                continue
            ratio = [med["kvproto"]["req_per_s"] / med[v]["req_per_s"]] + [
                med[v][k] / med["kvproto"][k] for k in keys[1:]
            ]
            print(f"{'vs ' + v:10} " + " ".join(f"{x:>10.2f}x" for x in ratio))
    print("\nthreads using >= 5% of the wall time (last round): cpu_s share cores")
    for r in results:
        if r["round"] != max(x["round"] for x in results):
            continue
        for role, rows in r["threads"].items():
            shown = "; ".join(
                f"{t['thread']} {t['cpu_s']} {t['share']} [{t['cores']}]" for t in rows
            )
            print(f"  {r['variant']:9} {role:8} {shown}")


if __name__ == "__main__":
    raise SystemExit(main())
