"""The ``kvproto`` command: ``simulate``, ``conformance``, ``bench``.

``kvproto simulate`` with no arguments runs every scenario under every policy
once and prints the comparison table; spec/simulator.md is its manual.
``conformance`` and ``bench`` hand their arguments to the transport
conformance kit and the benchmarks, imported only when asked for.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvproto_tools.sim.engine import RunResult
from kvproto_tools.sim.policies import POLICIES
from kvproto_tools.sim.report import plot, print_report, write_json
from kvproto_tools.sim.scenarios import DEFAULT_SET, FAULT_SCENARIOS, SCENARIOS
from kvproto_tools.sim.sweep import plan, sweep

_DELEGATES = {
    "conformance": "kvproto_transports.conformance.cli",
    "bench": "kvproto_tools.bench",
}

FENCED_POLICY = "kvproto"
"""The policy whose violations are bugs (the others' are their known failures)."""


def _names(value: str | None, known: Sequence[str], default: Sequence[str]) -> list[str]:
    if value is None:
        return list(default)
    if value == "all":
        return list(known)
    if value == "faults" and known == list(SCENARIOS):
        return list(FAULT_SCENARIOS)
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(
            f"kvproto simulate: unknown name(s) {', '.join(unknown)}; choose from "
            f"{', '.join(known)} or all"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    """``kvproto`` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="kvproto",
        description="kvproto tools: lease simulator, transport conformance, benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sim = sub.add_parser(
        "simulate",
        help="compare lease policies in the deterministic simulator",
        description=(
            "Run the deterministic lease simulator (the real kvproto core and a restatement "
            "of vLLM's lease v4, over the loopback transport) and compare the policies. "
            "With no options: every scenario, every policy, seed 0."
        ),
    )
    sim.add_argument("--scenario", metavar="NAME|all|faults",
                     help=f"scenario(s), comma-separated: {', '.join(SCENARIOS)}; "
                     "'faults' is every one but normal (default: all)")
    sim.add_argument("--policy", metavar="NAME|all",
                     help=f"policy(ies), comma-separated: {', '.join(POLICIES)} (default: all)")
    sim.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    sim.add_argument("--seeds", type=int, default=1, metavar="N",
                     help="number of seeds from --seed on (default 1)")
    sim.add_argument("--json", metavar="FILE", help='write {"runs": [...]} here')
    sim.add_argument("--plot", metavar="FILE.png", help="plot held blocks over time per policy")
    sim.add_argument("--liveness", action="store_true",
                     help="also check the liveness bounds (L1-L3)")
    sim.add_argument("--trace", action="store_true",
                     help="print the shortened trace of every run with a violation")
    sim.add_argument("--jobs", type=int, default=None, metavar="N",
                     help="worker processes (default: one per CPU)")
    for name, helptext in (
        ("conformance", "run the transport conformance suite (kvproto conformance --help)"),
        ("bench", "run the benchmarks (kvproto bench --help)"),
    ):
        p = sub.add_parser(name, help=helptext, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def _delegate(module: str, argv: Sequence[str], what: str) -> int:
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        print(f"kvproto {what}: not available in this installation ({exc})", file=sys.stderr)
        return 2
    entry: Callable[[Sequence[str]], int | None] | None = getattr(mod, "main", None)
    if entry is None:
        print(f"kvproto {what}: {module} has no main()", file=sys.stderr)
        return 2
    return int(entry(list(argv)) or 0)


def _violations(console: Console, results: Sequence[RunResult], *, trace_all: bool) -> int:
    """Print violating runs; returns how many kvproto runs violated an oracle."""
    bad = [r for r in results if r.violations or r.liveness]
    single = len(results) == 1
    fenced = [r for r in bad if r.policy == FENCED_POLICY]
    others = [r for r in bad if r.policy != FENCED_POLICY]
    for r in fenced + (others if trace_all or single else []):
        first = (r.violations + r.liveness)[0]
        console.print(
            f"[red]{r.policy} violated {first.kind}[/red] in {r.scenario} seed {r.seed} "
            f"({len(r.violations)} safety, {r.liveness_violations} liveness): {first.detail}"
        )
        console.print(f"  replay: kvproto simulate --scenario {r.scenario} --policy {r.policy} "
                      f"--seed {r.seed}{' --liveness' if r.liveness else ''} --trace")
        if first.trace:
            console.print("  last events before it:")
            for line in first.trace:
                console.print("    " + line, markup=False, highlight=False)
    if others and not (trace_all or single):
        by_policy: dict[str, list[RunResult]] = {}
        for r in others:
            by_policy.setdefault(r.policy, []).append(r)
        summary = "; ".join(
            f"{p}: {len(rs)} run(s), e.g. {rs[0].scenario} seed {rs[0].seed} "
            f"({(rs[0].violations + rs[0].liveness)[0].kind})"
            for p, rs in by_policy.items()
        )
        console.print(f"Known failures of the baselines reproduced - {summary}. "
                      "Add --trace to print their traces.")
    if not fenced:
        n = sum(r.policy == FENCED_POLICY for r in results)
        console.print(f"[green]{FENCED_POLICY}: no oracle violation in {n} run(s).[/green]")
    return len(fenced)


def simulate(args: argparse.Namespace) -> int:
    """``kvproto simulate``."""
    # A table of ten columns needs ~130 characters; a pipe or CI log gets that
    # width instead of rich's 80-column default.
    console = Console() if sys.stdout.isatty() else Console(width=140)
    scenarios = _names(args.scenario, list(SCENARIOS), DEFAULT_SET)
    policies = _names(args.policy, list(POLICIES), list(POLICIES))
    if args.seeds < 1 or (args.jobs is not None and args.jobs < 1):
        raise SystemExit("kvproto simulate: --seeds and --jobs must be at least 1")
    seeds = list(range(args.seed, args.seed + args.seeds))
    tasks = plan(scenarios, policies, seeds, liveness=args.liveness,
                 timelines=args.plot is not None)
    jobs = args.jobs or os.cpu_count() or 1
    console.print(
        f"Simulating {len(scenarios)} scenario(s) x {len(policies)} polic(ies) x "
        f"{len(seeds)} seed(s) = {len(tasks)} run(s) on {min(jobs, len(tasks))} process(es)"
        + (" with liveness checks" if args.liveness else "")
    )
    started = time.perf_counter()
    if len(tasks) > 1:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            job = bar.add_task("runs", total=len(tasks))
            results = sweep(tasks, jobs=jobs, progress=lambda r: bar.advance(job))
    else:
        results = sweep(tasks, jobs=1)
    wall = time.perf_counter() - started
    print_report(console, results, liveness=args.liveness, seeds=len(seeds))
    failures = _violations(console, results, trace_all=args.trace)
    if args.json:
        write_json(results, args.json)
        console.print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot)
        console.print(f"wrote {args.plot}")
    console.print(f"{len(tasks)} run(s) in {wall:.1f} s.")
    if not args.json and not args.plot:
        console.print("Add --plot held.png to see held blocks over time, --json runs.json for "
                      "the figures; spec/simulator.md explains every number.")
    return 1 if failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvproto`` console script."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    # Delegated commands own their options (argparse would claim a leading "--x").
    if args_list and args_list[0] in _DELEGATES:
        module = _DELEGATES[args_list[0]]
        return _delegate(module, args_list[1:], args_list[0])
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.command == "simulate":
        return simulate(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
