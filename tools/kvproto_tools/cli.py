"""The ``kvproto`` command: ``simulate``, ``conformance``, ``bench``, ``chaos``.

``kvproto simulate`` with no arguments runs every scenario under the four
default policies once and prints the comparison table; spec/simulator.md is
its manual, and ``kvproto simulate --explain`` prints its figures' definitions
(the wheel ships no spec/). ``conformance``, ``bench`` and ``chaos`` hand their arguments
to the transport conformance kit, the benchmarks and the chaos run (spec/chaos.md),
imported only when asked for.

Errors a user can make (an unknown or empty selection, an output path that
cannot be written, a missing optional dependency) are one line on stderr and
exit status 2, found before any work runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Callable, Sequence

from kvproto_tools.outpaths import OutputPathError, check_output, writing
from kvproto_tools.sim.console import Out, make_console, progress, survive_closed_stdout
from kvproto_tools.sim.engine import RunResult
from kvproto_tools.sim.explain import explain
from kvproto_tools.sim.oracles import Violation
from kvproto_tools.sim.policies import DEFAULT_POLICIES, POLICIES
from kvproto_tools.sim.report import LABELS, JsonRuns, Tally, print_rows
from kvproto_tools.sim.scenarios import DEFAULT_SET, FAULT_SCENARIOS, SCENARIOS
from kvproto_tools.sim.sweep import Plan, stream

EXTRA_OF = {"rich": "tools", "matplotlib": "tools"}
"""Optional modules and the extra that installs them."""


class UsageError(Exception):
    """A mistake in the command line: printed as one line, exit status 2."""


def version() -> str:
    """The installed distribution's version (the source tree's when run from a checkout)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kvproto")
    except PackageNotFoundError:
        import kvproto

        return kvproto.__version__


def install_hint(module: str | None) -> str:
    """``pip install 'kvproto[EXTRA]'`` for an optional module, or a plain pip line."""
    top = (module or "").split(".")[0]
    extra = EXTRA_OF.get(top)
    if extra is None:
        return f"pip install {top}" if top else "check the installation"
    return f"pip install 'kvproto[{extra}]' (the '{extra}' extra)"


_DELEGATES = {
    "conformance": "kvproto_transports.conformance.cli",
    "bench": "kvproto_tools.bench",
    "chaos": "kvproto_tools.chaos.cli",
}

FENCED_POLICY = "kvproto"
"""The policy whose violations are bugs (the others' are their known failures)."""


def _names(
    value: str | None, known: Sequence[str], default: Sequence[str], option: str
) -> list[str]:
    if value is None:
        return list(default)
    if value == "all":
        return list(known)
    if value == "faults" and option == "--scenario":
        return list(FAULT_SCENARIOS)
    names = [v.strip() for v in value.split(",") if v.strip()]
    choices = f"choose from {', '.join(known)} or all"
    if not names:
        raise UsageError(f"{option} is empty; {choices}")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UsageError(f"unknown {option} {', '.join(unknown)}; {choices}")
    return list(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    """``kvproto`` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="kvproto",
        description="kvproto tools: lease simulator, transport conformance, benchmarks.",
    )
    parser.add_argument("--version", action="version", version=f"kvproto {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sim = sub.add_parser(
        "simulate",
        help="compare lease policies in the deterministic simulator",
        description=(
            "Run the deterministic lease simulator (the real kvproto core and a restatement "
            "of vLLM 0.32.0's leases, over the loopback transport) and compare the policies. "
            f"With no options: every scenario, the policies {', '.join(DEFAULT_POLICIES)}, "
            "seed 0."
        ),
    )
    sim.add_argument(
        "--scenario",
        metavar="NAME|all|faults",
        help=f"scenario(s), comma-separated: {', '.join(SCENARIOS)}; "
        "'faults' is every one but normal (default: all)",
    )
    sim.add_argument(
        "--policy",
        metavar="NAME|all",
        help=f"policy(ies), comma-separated: {', '.join(POLICIES)} "
        f"(default: {','.join(DEFAULT_POLICIES)}; all adds the historical vllm-v4)",
    )
    sim.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    sim.add_argument(
        "--seeds",
        type=int,
        default=1,
        metavar="N",
        help="number of seeds from --seed on (default 1)",
    )
    sim.add_argument("--json", metavar="FILE", help='write {"runs": [...]} here')
    sim.add_argument(
        "--plot",
        metavar="FILE.png",
        help="plot held blocks over time per policy (.png, .svg or .pdf; needs matplotlib)",
    )
    sim.add_argument(
        "--liveness", action="store_true", help="also check the liveness bounds (L1-L3)"
    )
    sim.add_argument(
        "--trace",
        action="store_true",
        help="print the shortened trace of every run with a violation",
    )
    sim.add_argument(
        "--explain",
        action="store_true",
        help="print what every figure of the table means, then exit",
    )
    sim.add_argument(
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="worker processes (default: one per CPU)",
    )
    for name, helptext in (
        ("conformance", "run the transport conformance suite (kvproto conformance --help)"),
        ("bench", "run the benchmarks (kvproto bench --help)"),
        ("chaos", "faults mixed with traffic on the real P/D deployment (kvproto chaos --help)"),
    ):
        p = sub.add_parser(name, help=helptext, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def _delegate(module: str, argv: Sequence[str], what: str) -> int:
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        if exc.name and exc.name.split(".")[0] in EXTRA_OF:
            print(
                f"kvproto {what}: needs {exc.name.split('.')[0]}; install it with "
                f"{install_hint(exc.name)}",
                file=sys.stderr,
            )
        else:
            print(f"kvproto {what}: not available in this installation ({exc})", file=sys.stderr)
        return 2
    entry: Callable[[Sequence[str]], int | None] | None = getattr(mod, "main", None)
    if entry is None:
        print(f"kvproto {what}: {module} has no main()", file=sys.stderr)
        return 2
    return int(entry(list(argv)) or 0)


class Findings:
    """The violating runs the report prints, kept while the runs stream past.

    kvproto's violations are bugs: every such run is kept and printed in full.
    The baselines' are their known failures: kept and printed in full only when
    asked for (``--trace``, or a single run), else counted per policy with the
    first run as the example, so a long sweep keeps a few runs, not millions.
    """

    def __init__(self, *, in_full: bool) -> None:
        self.in_full = in_full
        self.fenced: list[RunResult] = []
        self.baselines: list[RunResult] = []
        self.known: dict[str, tuple[int, RunResult]] = {}
        self.fenced_runs = 0

    def add(self, r: RunResult) -> None:
        """Look at one run (in canonical order)."""
        if r.policy == FENCED_POLICY:
            self.fenced_runs += 1
        if not (r.violations or r.liveness):
            return
        if r.policy == FENCED_POLICY:
            self.fenced.append(r)
        elif self.in_full:
            self.baselines.append(r)
        else:
            count, first = self.known.get(r.policy, (0, r))
            self.known[r.policy] = (count + 1, first)


def _violations(console: Out, found: Findings) -> int:
    """Print violating runs; returns how many kvproto runs violated an oracle."""
    for r in found.fenced + found.baselines:
        _print_violation(console, r)
    if found.known:
        console.print(_known_failures(found.known))
    if not found.fenced:
        console.print(
            f"[green]{FENCED_POLICY}: no oracle violation in {found.fenced_runs} run(s).[/green]"
        )
    return len(found.fenced)


def _first_violation(r: RunResult) -> Violation:
    """The run's first safety violation, else its first liveness one."""
    return (r.violations + r.liveness)[0]


def _print_violation(console: Out, r: RunResult) -> None:
    """One violating run: its first violation, the command that replays it, its trace."""
    first = _first_violation(r)
    console.print(
        f"[red]{r.policy} violated {first.kind}[/red] in {r.scenario} seed {r.seed} "
        f"({len(r.violations)} safety, {r.liveness_violations} liveness): {first.detail}"
    )
    console.print(
        f"  replay: kvproto simulate --scenario {r.scenario} --policy {r.policy} "
        f"--seed {r.seed}{' --liveness' if r.liveness else ''} --trace"
    )
    if first.trace:
        console.print("  last events before it:")
        for line in first.trace:
            console.print("    " + line, markup=False, highlight=False)


def _known_failures(known: dict[str, tuple[int, RunResult]]) -> str:
    """One line for the baselines' violating runs: per policy, how many and one example."""
    summary = "; ".join(
        f"{p}: {count} run(s), e.g. {first.scenario} seed {first.seed} "
        f"({_first_violation(first).kind})"
        for p, (count, first) in known.items()
    )
    return (
        f"Known failures of the baselines reproduced - {summary}. "
        "Add --trace to print their traces."
    )


def _check_simulate(args: argparse.Namespace) -> tuple[list[str], list[str], range]:
    """Everything a simulate command line can get wrong, before any run starts."""
    scenarios = _names(args.scenario, list(SCENARIOS), DEFAULT_SET, "--scenario")
    policies = _names(args.policy, list(POLICIES), DEFAULT_POLICIES, "--policy")
    if args.seeds < 1:
        raise UsageError(f"--seeds must be at least 1 (got {args.seeds})")
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1 (got {args.jobs})")
    try:
        if args.json is not None:
            check_output(args.json, "--json")
        if args.plot is not None:
            check_output(args.plot, "--plot", plot=True)
    except OutputPathError as exc:
        raise UsageError(str(exc)) from None
    if args.plot is not None and all(SCENARIOS[s].push is not None for s in scenarios):
        raise UsageError("--plot draws held blocks of pull scenarios; push runs record none")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError(
                f"--plot needs matplotlib; install it with {install_hint('matplotlib')}"
            ) from None
    return scenarios, policies, range(args.seed, args.seed + args.seeds)


class _Collected:
    """What the report needs from a sweep, gathered run by run (no run is kept for the table)."""

    def __init__(self, args: argparse.Namespace, total: int) -> None:
        self.tally = Tally()
        self.found = Findings(in_full=args.trace or total == 1)
        self.json = JsonRuns() if args.json else None
        self.timelines: list[RunResult] = []

    def add(self, r: RunResult) -> None:
        self.tally.add(r)
        self.found.add(r)
        if self.json is not None:
            self.json.add(r)
        if r.timeline:
            self.timelines.append(r)


def _run_all(console: Out, tasks: Plan, jobs: int, args: argparse.Namespace) -> _Collected:
    """Run the sweep, feeding each run to the collectors as it ends, with progress."""
    got = _Collected(args, len(tasks))
    if len(tasks) > 1:
        with progress(console, len(tasks)) as advance:
            for r in stream(tasks, len(tasks), jobs=jobs, progress=lambda r: advance()):
                got.add(r)
    else:
        for r in stream(tasks, len(tasks), jobs=1):
            got.add(r)
    return got


def simulate(args: argparse.Namespace) -> int:
    """``kvproto simulate``."""
    # A table of ten columns needs ~130 characters; a pipe or CI log gets that
    # width instead of rich's 80-column default.
    console = make_console(width=140)
    if args.explain:
        explain(console, LABELS)
        return 0
    scenarios, policies, seeds = _check_simulate(args)
    tasks = Plan(
        scenarios=scenarios,
        policies=policies,
        seeds=seeds,
        liveness=args.liveness,
        timelines=args.plot is not None,
    )
    jobs = args.jobs or os.cpu_count() or 1
    console.print(
        f"Simulating {len(scenarios)} scenario(s) x {len(policies)} polic(ies) x "
        f"{len(seeds)} seed(s) = {len(tasks)} run(s) on {min(jobs, len(tasks))} process(es)"
        + (" with liveness checks" if args.liveness else "")
    )
    started = time.perf_counter()
    got = _run_all(console, tasks, jobs, args)
    wall = time.perf_counter() - started
    print_rows(console, got.tally.rows(), liveness=args.liveness, seeds=len(seeds))
    failures = _violations(console, got.found)
    _write_outputs(console, args, got)
    console.print(f"{len(tasks)} run(s) in {wall:.1f} s.")
    if not args.json and not args.plot:
        console.print(
            "Add --plot held.png to see held blocks over time, --json runs.json for "
            "the figures; kvproto simulate --explain says what every number means."
        )
    return 1 if failures else 0


def _write_outputs(console: Out, args: argparse.Namespace, got: _Collected) -> None:
    """The --json and --plot files; a write that fails after all is a usage error."""
    try:
        if got.json is not None:
            with writing(args.json, "--json"):
                got.json.write(args.json)
            console.print(f"wrote {args.json}")
        if args.plot:
            from kvproto_tools.sim.report import plot

            with writing(args.plot, "--plot"):
                plot(got.timelines, args.plot)
            console.print(f"wrote {args.plot}")
    except OutputPathError as exc:
        raise UsageError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvproto`` console script."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    survive_closed_stdout()
    # Delegated commands own their options (argparse would claim a leading "--x").
    if args_list and args_list[0] in _DELEGATES:
        module = _DELEGATES[args_list[0]]
        return _delegate(module, args_list[1:], args_list[0])
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.command == "simulate":
        try:
            return simulate(args)
        except UsageError as exc:
            print(f"kvproto simulate: {exc}", file=sys.stderr)
            return 2
    parser.print_help()
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
