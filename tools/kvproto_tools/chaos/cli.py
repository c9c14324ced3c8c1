"""``kvproto chaos``: run the chaos run (or re-check a saved one), write its report and plot.

Mistakes on the command line and what the machine lacks (root and network
namespaces, vLLM and vllm-router, examples/pd_cpu from a checkout, matplotlib)
are one line on stderr and exit status 2, before anything starts. A run exits
0 when the checker finds nothing, 1 when it found a violation (the report
lists them).
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import NoReturn

import msgspec

from kvproto.config import ConfigError, LeaseConfig
from kvproto_tools.chaos import driver, report
from kvproto_tools.chaos.checker import check
from kvproto_tools.chaos.schedule import FAULT_KINDS, checked_kinds
from kvproto_tools.chaos.simcompare import compare
from kvproto_tools.outpaths import OutputPathError, check_output, writing

REPORT_FILE, PLOT_FILE, VERDICT_FILE = "report.txt", "chaos.png", "verdict.json"
MIN_DURATION_S = 60.0
"""Shorter runs have no room for a fault after the warm-up."""
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


class UsageError(Exception):
    """A mistake on the command line, or something missing here: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"kvproto chaos: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """The ``kvproto chaos`` options."""
    parser = _Parser(
        prog="kvproto chaos",
        description=(
            "Run two prefill engines and a decoder (vllm serve, KvprotoConnector) behind "
            "vllm-router on hosts in network namespaces, send a steady mixed load, inject a "
            "seeded schedule of faults (kill -9 and restart, partitions, loss, link flaps), "
            "then check the history: every answer equal to a plain engine's, every lease "
            "ended once and for a reason a fault explains, leases reclaimed within the "
            "derived bounds, no unscheduled crash, memory flat; the simulator runs the same "
            "schedule. Needs root (namespaces), vLLM and vllm-router, and a checkout "
            "(examples/pd_cpu). spec/chaos.md explains every figure."
        ),
    )
    parser.add_argument("--out", metavar="DIR", required=True, help="history, logs, report, plot")
    parser.add_argument(
        "--duration", default="3m", help="load duration: 90s, 3m, 30m, 1h (default %(default)s)"
    )
    parser.add_argument("--seed", default="0", help="the schedule's seed (default %(default)s)")
    parser.add_argument(
        "--rate", default="1.5", help="steady requests per second (default %(default)s)"
    )
    parser.add_argument(
        "--lease", default="10", help="kv_lease_duration, seconds (default %(default)s)"
    )
    parser.add_argument(
        "--faults",
        default=",".join(FAULT_KINDS),
        metavar="KINDS",
        help="the kinds of fault to draw, comma-separated (default: all, %(default)s)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not run: check the run saved in --out again and rewrite its report",
    )
    return parser


def duration_s(text: str) -> float:
    """``90``, ``90s``, ``3m``, ``0.5h`` in seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if m is None:
        raise UsageError(f"--duration {text!r}: a number with s, m or h (90s, 3m, 30m, 1h)")
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if seconds < MIN_DURATION_S:
        raise UsageError(f"--duration {text}: at least {MIN_DURATION_S:.0f} s")
    return seconds


def _number(text: str, option: str, kind: type[int] | type[float]) -> float:
    try:
        value = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise UsageError(f"{option} {text!r}: not {what}") from None
    return value


def _check_machine() -> None:
    """Root, namespaces, vLLM, vllm-router and the checkout's examples, or one line why not."""
    from kvproto_tools.bench.engine_suites import SuiteUnavailable, pd_cpu
    from kvproto_tools.netns import unavailable_reason

    why = unavailable_reason()
    if why is not None:
        raise UsageError(f"the engine hosts are network namespaces, and here {why}")
    try:
        pd_cpu("cluster")
    except SuiteUnavailable as exc:
        raise UsageError(str(exc)) from None
    beside = Path(sys.executable).parent / "vllm-router"
    if shutil.which("vllm-router") is None and not beside.exists():
        raise UsageError("vllm-router is not installed (pip install vllm-router==0.1.17)")


def _options(args: argparse.Namespace) -> driver.Options:
    """The run's options, after every check that can be made before anything starts."""
    out = Path(args.out)
    if args.check:
        files = (driver.HISTORY_FILE, driver.BASELINE_FILE)
        missing = [n for n in files if not (out / n).is_file()]
        if missing:
            raise UsageError(f"--check: {out} has no {' or '.join(missing)} (no saved run)")
    elif not out.is_dir():
        if out.exists():
            raise UsageError(f"--out {out}: is a file, not a directory")
        if not out.parent.is_dir():
            raise UsageError(f"--out {out}: directory {out.parent} does not exist")
    try:
        check_output(out / REPORT_FILE if out.is_dir() else out, "--out")
    except OutputPathError as exc:
        raise UsageError(str(exc)) from None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(
            "the plot needs matplotlib; install it with pip install 'kvproto[tools]'"
        ) from None
    seed = int(_number(args.seed, "--seed", int))
    rate = _number(args.rate, "--rate", float)
    if rate <= 0:
        raise UsageError(f"--rate {args.rate}: must be positive")
    lease = int(_number(args.lease, "--lease", int))
    try:
        LeaseConfig(kv_lease_duration=lease)
    except ConfigError as exc:
        raise UsageError(f"--lease {lease}: {exc}") from None
    try:
        kinds = checked_kinds([k.strip() for k in args.faults.split(",") if k.strip()])
    except ValueError as exc:
        raise UsageError(f"--faults {args.faults!r}: {exc}") from None
    options = driver.Options(
        seed=seed,
        duration_s=duration_s(args.duration),
        out=out,
        rate=rate,
        lease_s=lease,
        fault_kinds=kinds,
    )
    if not args.check:
        _check_machine()
    return options


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """``kvproto chaos``; 0 when the checker is clean, 1 on a violation, 2 on a usage error."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        options = _options(args)
    except UsageError as exc:
        print(f"kvproto chaos: {exc}", file=sys.stderr)
        return 2
    out = options.out
    started = time.monotonic()

    def say(line: str) -> None:
        print(f"[{time.monotonic() - started:7.1f} s] {line}", flush=True)

    if args.check:
        try:
            outcome = driver.load(out)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            print(
                f"kvproto chaos: --check: {out} holds no run this version reads ({exc})",
                file=sys.stderr,
            )
            return 2
    else:
        out.mkdir(exist_ok=True)
        # SIGTERM as Ctrl-C: every process tree stopped and every namespace deleted on the way.
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            outcome = driver.run(options, say)
        except KeyboardInterrupt:
            print("kvproto chaos: interrupted; everything it started is stopped", file=sys.stderr)
            return 130
    say("checking the history; the simulator runs the same schedule")
    verdict = check(outcome.history, outcome.expected)
    lines, disagreements = compare(outcome.history, verdict)
    verdict.violations += disagreements
    text = report.text(outcome.history, verdict, lines)
    try:
        with writing(out / REPORT_FILE, "--out"):
            (out / REPORT_FILE).write_text(text)
            (out / VERDICT_FILE).write_bytes(msgspec.json.encode(verdict))
            report.plot(outcome.history, verdict, out / PLOT_FILE)
    except OutputPathError as exc:
        print(f"kvproto chaos: {exc}", file=sys.stderr)
        return 2
    print(text, end="")
    say(f"wrote {out / REPORT_FILE} and {out / PLOT_FILE}")
    return 0 if verdict.clean else 1
