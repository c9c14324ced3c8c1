"""``kvproto bench``: argument parsing, output (table, JSON, PNG) and the exit status."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from kvproto_tools.bench import machine, scaling, suite, table
from kvproto_tools.bench.figures import write_json
from kvproto_tools.bench.plan import FULL, QUICK
from kvproto_tools.outpaths import OutputPathError, check_output


def build_parser() -> argparse.ArgumentParser:
    """The ``kvproto bench`` options."""
    parser = argparse.ArgumentParser(
        prog="kvproto bench",
        description=(
            "Measure kvproto beside the restated vLLM 0.32.0 lease path (and beside raw "
            "transports) in one process; print figures, anchors and ratios."
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
        "--no-transports",
        action="store_true",
        help="skip the NIXL and UCX overhead figures (loopback is always measured)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite; 0 on success (a missed target is reported, not an error)."""
    rest = list(sys.argv[1:] if argv is None else argv)
    if rest[:1] == ["--"]:  # tolerate `kvproto bench -- --quick` from a REMAINDER-style wrapper
        rest = rest[1:]
    args = build_parser().parse_args(rest)
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
        console.print(f"[dim]{line}[/]")

    figures = suite.run(plan, say, transports=not args.no_transports)
    table.print_report(console, figures)
    info = machine.describe(quick=plan.quick, elapsed_s=time.monotonic() - start)
    if args.json is not None:
        write_json(args.json, info, figures)
        say(f"wrote {args.json}")
    if args.plot is not None:
        scaling.plot(figures, args.plot)
        say(f"wrote {args.plot}")
    return 0
