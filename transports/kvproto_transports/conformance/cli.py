"""``kvproto conformance --transport NAME [--strict] [--json FILE] [--junit FILE] [--jobs N]``.

Exit status: 0 when no case is FAIL, 1 when one is (a MUST failed, or a SHOULD
under ``--strict``), 2 for usage errors: an unknown transport, a ``--case``
that selects nothing, an output path that cannot be written, or a transport
that cannot start here (its library is missing). Each is one line on stderr,
found before any case runs.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from kvproto_tools.outpaths import OutputPathError, check_output, writing
from kvproto_transports.conformance.discovery import (
    UnknownTransport,
    available,
    install_hint,
    load_factory,
)
from kvproto_transports.conformance.factory import TransportFactory
from kvproto_transports.conformance.registry import all_cases
from kvproto_transports.conformance.report import print_table, write_json, write_junit
from kvproto_transports.conformance.runner import run_conformance, select

_LIBRARY_HINT = re.compile(r";?\s*pip install [^;]*$")
"""A transport's own install hint at the end of its message (it names the library unpinned)."""


class _Usage(Exception):
    """One line for stderr; exit status 2."""


def _check_outputs(args: argparse.Namespace) -> None:
    try:
        if args.json:
            check_output(args.json, "--json")
        if args.junit:
            check_output(args.junit, "--junit")
    except OutputPathError as exc:
        raise _Usage(str(exc)) from None


def _check_cases(only: Sequence[str] | None) -> None:
    if only is None:
        return
    cases = all_cases()
    empty = [w for w in only if not w.strip()]
    if empty:
        raise _Usage("--case is empty; kvproto conformance --list shows the case ids")
    unknown = [w for w in only if not select(cases, [w])]
    if unknown:
        raise _Usage(
            f"--case {', '.join(unknown)} matches no case; kvproto conformance "
            "--list shows the case ids (T2.1) and groups (T2)"
        )


def _preflight(name: str) -> TransportFactory:
    """Load the transport and start one endpoint, so a missing library is one line."""
    try:
        factory = load_factory(name)
    except UnknownTransport as exc:
        raise _Usage(str(exc)) from None
    try:
        factory.create_group(1).close()
    except Exception as exc:
        raise _Usage(_cannot_start(name, exc)) from None
    return factory


def _cannot_start(name: str, exc: Exception) -> str:
    """Why ``name`` cannot start, and, when a library is missing, the one line that installs it.

    The install line is the extra's, with the pins pyproject.toml declares, so the
    transport's own unpinned hint is dropped from its message: one line to run, not two.
    """
    missing = (
        isinstance(exc, ImportError)
        or isinstance(exc.__cause__, ImportError)
        or type(exc).__name__.endswith("Unavailable")
    )
    what = _one_line(exc)
    if not isinstance(exc, ImportError):
        what = f"{type(exc).__name__}: {what}"
    if not missing:
        return f"transport {name!r} cannot start: {what}"
    hint = install_hint(name) or "install the library it needs"
    return f"transport {name!r} cannot start: {_LIBRARY_HINT.sub('', what)}; {hint}"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _jobs(text: str) -> int:
    try:
        jobs = int(text)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise argparse.ArgumentTypeError(f"a whole number of processes, 1 or more: {text!r}")
    return jobs


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
    p.add_argument(
        "--case",
        action="append",
        metavar="ID",
        help="run only this case or group (T2, T3.2); repeatable",
    )
    p.add_argument(
        "--jobs",
        type=_jobs,
        default=1,
        metavar="N",
        help="run the cases in N processes (default 1); for transports slow to start or stop",
    )
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
    try:
        if not args.transport:
            raise _Usage("--transport NAME is required (kvproto conformance --list shows them)")
        _check_cases(args.case)
        _check_outputs(args)
        _preflight(args.transport)
    except _Usage as exc:
        print(f"kvproto conformance: {exc}", file=sys.stderr)
        return 2
    report = run_conformance(args.transport, strict=args.strict, only=args.case, jobs=args.jobs)
    print_table(report)
    try:
        if args.json:
            with writing(args.json, "--json"):
                write_json(report, args.json)
        if args.junit:
            with writing(args.junit, "--junit"):
                write_junit(report, args.junit)
    except OutputPathError as exc:
        print(f"kvproto conformance: {exc}", file=sys.stderr)
        return 2
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
