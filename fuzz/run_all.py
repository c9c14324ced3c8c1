"""Run every atheris target for a total number of inputs, in parallel, and report.

    pip install atheris
    python fuzz/run_all.py --runs 10000000            # about 15 min on 2 cores

The total is split evenly over the targets, each target's share into chunks that run
as separate libFuzzer processes (``--jobs`` at a time) sharing one corpus directory
per target, so later chunks start from what earlier ones found. Every chunk gets its
own libFuzzer seed. A target that finds an input breaking its contract exits non-zero
and leaves the input under ``OUT/crashes/``; this script then exits 1.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGETS = {
    "wire": "fuzz_wire.py",  # kvproto frames: wire.decode + Holder/Reader.handle_frame
    "legacy": "fuzz_legacy.py",  # stock-vLLM text frames: legacy.parse + legacy holder
    "ticket": "fuzz_ticket.py",  # kv_transfer_params: LeaseTicket.from_params + Reader
    "handshake": "fuzz_handshake.py",  # side-channel request/reply payloads
    "metadata": "fuzz_metadata.py",  # NIXL/UCX endpoint metadata, UCX HELLO bodies
}
CHUNK = 250_000


@dataclass
class Result:
    target: str
    runs: int = 0
    seconds: float = 0.0
    chunks: int = 0
    crashes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def run_chunk(target: str, runs: int, seed: int, out: Path) -> tuple[str, int, float, str, str]:
    corpus = out / "corpus" / target
    crashes = out / "crashes"
    cmd = [
        sys.executable,
        str(HERE / TARGETS[target]),
        f"-runs={runs}",
        f"-seed={seed}",
        "-max_len=4096",
        "-print_final_stats=1",
        f"-artifact_prefix={crashes}/{target}-",
        str(corpus),
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE, check=False)
    elapsed = time.monotonic() - start
    log = proc.stdout + proc.stderr
    done = re.findall(r"stat::number_of_executed_units:\s*(\d+)", log)
    executed = int(done[-1]) if done else 0
    crash = ""
    if proc.returncode != 0:
        units = re.findall(r"Test unit written to (\S+)", log)
        crash = units[-1] if units else f"exit {proc.returncode}: {log[-2000:]}"
    return target, executed, elapsed, crash, log[-4000:] if crash else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10_000_000, help="total inputs, all targets")
    parser.add_argument("--jobs", type=int, default=2, help="fuzzer processes at a time")
    parser.add_argument(
        "--targets", default=",".join(TARGETS), help=f"comma-separated, of {list(TARGETS)}"
    )
    parser.add_argument("--out", type=Path, default=None, help="corpus, crashes and summary")
    args = parser.parse_args()
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        parser.error(f"unknown targets: {unknown}")
    out = args.out or Path(tempfile.mkdtemp(prefix="kvproto-fuzz-"))
    (out / "crashes").mkdir(parents=True, exist_ok=True)
    for target in targets:
        corpus = out / "corpus" / target
        corpus.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, str(HERE / TARGETS[target]), "--write-seeds", str(corpus)],
            cwd=HERE,
            check=True,
            capture_output=True,
        )

    share, extra = divmod(args.runs, len(targets))
    work = []
    for target in targets:
        left, n = share + (1 if targets.index(target) < extra else 0), 0
        while left > 0:
            runs = min(CHUNK, left)
            work.append((target, runs, 1000 * (1 + targets.index(target)) + n))
            left -= runs
            n += 1
    # Interleave targets so that slow and fast ones share the workers.
    work.sort(key=lambda w: (w[2] % 1000, targets.index(w[0])))

    results = {t: Result(t) for t in targets}
    start = time.monotonic()
    print(f"fuzzing {targets}: {args.runs} inputs in {len(work)} chunks, {args.jobs} at a time")
    print(f"output: {out}", flush=True)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_chunk, t, r, s, out) for t, r, s in work]
        for fut in futures:
            target, executed, elapsed, crash, log = fut.result()
            res = results[target]
            res.runs += executed
            res.seconds += elapsed
            res.chunks += 1
            if crash:
                res.crashes.append(crash)
                res.errors.append(log)
                print(f"  {target}: CONTRACT BROKEN, input at {crash}", flush=True)
    wall = time.monotonic() - start

    total = sum(r.runs for r in results.values())
    print(f"\n{'target':<10} {'inputs':>12} {'cpu-s':>8} {'inputs/s':>9} crashes")
    for r in results.values():
        rate = r.runs / r.seconds if r.seconds else 0.0
        print(f"{r.target:<10} {r.runs:>12,} {r.seconds:>8.0f} {rate:>9.0f} {len(r.crashes)}")
    print(f"{'total':<10} {total:>12,}   wall {wall:.0f} s")
    summary = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "total_inputs": total,
        "wall_seconds": round(wall, 1),
        "targets": {
            t: asdict(r) | {"errors": [e[-600:] for e in r.errors]} for t, r in results.items()
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 1 if any(r.crashes for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
