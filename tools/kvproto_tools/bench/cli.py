"""``kvproto bench``: argument parsing, output (table, JSON, PNG) and the exit status.

The one benchmark entry point. ``--suite`` picks what runs (comma-separated):
the in-process suites ``core`` (holder, reader, scaling), ``memory`` and
``transport`` run by default; the engine suites ``vllm-step`` (per-step
connector cost inside real vLLM engines) and ``http`` (the deployment through
vllm-router) start real engines, need vLLM and examples/pd_cpu, and take
minutes, so they run only when named.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from kvproto_tools.bench import http_bench, machine, scaling, step_bench, suite, table
from kvproto_tools.bench.engine_suites import SuiteUnavailable, pd_cpu
from kvproto_tools.bench.figures import Figure, write_json
from kvproto_tools.bench.plan import FULL, QUICK
from kvproto_tools.outpaths import OutputPathError, check_output


def build_parser() -> argparse.ArgumentParser:
    """The ``kvproto bench`` options."""
    parser = argparse.ArgumentParser(
        prog="kvproto bench",
        description=(
            "Measure kvproto beside the restated vLLM 0.32.0 lease path (and beside raw "
            "transports) in one process, or (--suite vllm-step, http) beside stock "
            "NixlConnector in real vLLM engines; print figures, anchors and ratios."
        ),
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the figures as JSON")
    parser.add_argument(
        "--plot", type=Path, metavar="FILE.png", help="write the scaling plot (.png, .svg or .pdf)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, a few seconds (smoke test)"
    )
    parser.add_argument(
        "--suite",
        default=",".join(suite.CORE_SUITES),
        metavar="NAME[,NAME]",
        help=f"what to run, from {', '.join(SUITES)} (default: %(default)s; "
        "vllm-step and http start real vLLM engines and take minutes)",
    )
    parser.add_argument(
        "--no-transports",
        action="store_true",
        help="skip the NIXL and UCX overhead figures (loopback is always measured)",
    )
    http = parser.add_argument_group("http suite")
    default = http_bench.HttpPlan()
    http.add_argument(
        "--requests", type=int, default=default.requests, help="per variant and round (%(default)s)"
    )
    http.add_argument(
        "--concurrency", type=int, default=default.concurrency, help="in flight (%(default)s)"
    )
    http.add_argument(
        "--rounds", type=int, default=default.rounds, help="deployments per variant (%(default)s)"
    )
    http.add_argument(
        "--variants",
        default=",".join(http_bench.VARIANTS),
        help="kvproto and the stock variants to compare it with (default: %(default)s)",
    )
    return parser


SUITES = (*suite.CORE_SUITES, "vllm-step", "http")
ENGINE_SUITES = ("vllm-step", "http")


def _suites(value: str) -> list[str]:
    names = [s.strip() for s in value.split(",") if s.strip()]
    unknown = [s for s in names if s not in SUITES]
    if unknown or not names:
        raise ValueError(f"--suite: choose from {', '.join(SUITES)} (got {value!r})")
    return list(dict.fromkeys(names))


def _http_plan(args: argparse.Namespace, quick: bool) -> http_bench.HttpPlan:
    if quick:
        return http_bench.HTTP_QUICK
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    return http_bench.HttpPlan(
        requests=args.requests,
        concurrency=args.concurrency,
        rounds=args.rounds,
        variants=variants,
    )


def _check_suites(suites: list[str], http_plan: http_bench.HttpPlan, *, plot: bool) -> str | None:
    """Why the chosen suites cannot run here, before anything is measured; or None."""
    if plot and "core" not in suites:
        return "--plot draws the scaling curve, which the core suite measures (--suite core)"
    if "http" in suites and (problem := http_bench.check(http_plan)) is not None:
        return problem
    for name in (s for s in suites if s in ENGINE_SUITES):
        try:
            pd_cpu("cluster")
        except SuiteUnavailable as exc:
            return f"--suite {name}: {exc}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen suites; 0 on success (a missed target is reported, not an error)."""
    rest = list(sys.argv[1:] if argv is None else argv)
    if rest[:1] == ["--"]:  # tolerate `kvproto bench -- --quick` from a REMAINDER-style wrapper
        rest = rest[1:]
    args = build_parser().parse_args(rest)
    try:
        suites = _suites(args.suite)
    except ValueError as exc:
        print(f"kvproto bench: {exc}", file=sys.stderr)
        return 2
    http_plan = _http_plan(args, args.quick)
    problem = _check_suites(suites, http_plan, plot=args.plot is not None)
    if problem is not None:
        print(f"kvproto bench: {problem}", file=sys.stderr)
        return 2
    try:  # before the suite runs: a bad path must not cost the measurements
        if args.json is not None:
            check_output(args.json, "--json")
        if args.plot is not None:
            check_output(args.plot, "--plot", plot=True)
            import matplotlib  # noqa: F401
    except OutputPathError as exc:
        print(f"kvproto bench: {exc}", file=sys.stderr)
        return 2
    except ImportError:
        print(
            "kvproto bench: --plot needs matplotlib; install it with "
            "pip install 'kvproto[tools]' (the 'tools' extra)",
            file=sys.stderr,
        )
        return 2
    plan = QUICK if args.quick else FULL
    width = None if sys.stdout.isatty() else 180
    console = Console(width=width, highlight=False)
    start = time.monotonic()

    def say(line: str) -> None:
        console.print(f"[dim]{escape(line)}[/]")  # log lines may hold brackets: cores "[0-1]"

    figures: list[Figure] = []
    in_process = [s for s in suites if s in suite.CORE_SUITES]
    if in_process:
        figures += suite.run(plan, say, transports=not args.no_transports, suites=in_process)
    if "vllm-step" in suites:
        figures += step_bench.measure(
            step_bench.STEP_QUICK if args.quick else step_bench.STEP_FULL, say
        )
    if "http" in suites:
        figures += http_bench.measure(http_plan, say)
    table.print_report(console, figures)
    info = machine.describe(quick=plan.quick, elapsed_s=time.monotonic() - start)
    info["suites"] = suites
    if args.json is not None:
        write_json(args.json, info, figures)
        say(f"wrote {args.json}")
    if args.plot is not None:
        scaling.plot(figures, args.plot)
        say(f"wrote {args.plot}")
    return 0
