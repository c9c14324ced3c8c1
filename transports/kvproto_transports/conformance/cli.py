"""``kvproto conformance --transport NAME [--strict] [--json FILE] [--junit FILE]``.

Exit status: 0 when no case is FAIL, 1 when one is (a MUST failed, or a SHOULD
under ``--strict``), 2 for usage errors such as an unknown transport.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvproto_transports.conformance.discovery import UnknownTransport, available
from kvproto_transports.conformance.registry import all_cases
from kvproto_transports.conformance.report import print_table, write_json, write_junit
from kvproto_transports.conformance.runner import run_conformance


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (the lead's ``kvproto`` CLI may embed it as a subcommand)."""
    p = argparse.ArgumentParser(
        prog="kvproto conformance",
        description="Run the transport conformance suite against an installed transport.",
    )
    p.add_argument("--transport", help="entry-point name in 'kvproto.transports'")
    p.add_argument("--strict", action="store_true", help="SHOULD failures are FAIL")
    p.add_argument("--json", metavar="FILE", help="write the JSON report here")
    p.add_argument("--junit", metavar="FILE", help="write a JUnit XML report here")
    p.add_argument("--case", action="append", metavar="ID",
                   help="run only this case or group (T2, T3.2); repeatable")
    p.add_argument("--list", action="store_true", help="list transports and cases, then exit")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.list:
        print("transports:", ", ".join(sorted(available())) or "none installed")
        for c in all_cases():
            print(f"  {c.id:<6} {c.level.value:<6} {c.title}")
        return 0
    if not args.transport:
        print("kvproto conformance: --transport NAME is required", file=sys.stderr)
        return 2
    try:
        report = run_conformance(args.transport, strict=args.strict, only=args.case)
    except UnknownTransport as exc:
        print(f"kvproto conformance: {exc}", file=sys.stderr)
        return 2
    print_table(report)
    if args.json:
        write_json(report, args.json)
    if args.junit:
        write_junit(report, args.junit)
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
