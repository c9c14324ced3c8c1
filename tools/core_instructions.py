"""Instructions per operation of the cores' per-request paths, counted by callgrind.

    python tools/core_instructions.py                 # every operation, 300 leases
    python tools/core_instructions.py claim done --leases 1000

For each operation it runs this script twice under ``valgrind --tool=callgrind``
(``PYTHONHASHSEED=0``, the cyclic GC off, the kvproto modules compiled first):
once building the fixture only, once building it and running the operation on
every item, and prints the difference per item. Instruction counts do not
depend on the machine's load, so two trees compare in one sitting. Needs
valgrind; not part of the wheel (spec/benchmarks.md quotes its figures).

Operations: ``claim`` (the holder applies the claim frames of N fresh tracks),
``track`` (the reader tracks N tickets on an open session), ``done`` (the
holder answers N dones), ``beat`` (the holder applies 200 steady heartbeats of
a session holding N leases), ``idle`` (2,000 idle steps of both cores).
"""

from __future__ import annotations

import argparse
import compileall
import gc
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from kvproto.config import LeaseConfig
from kvproto.events import Connect, ReadGo, SendFrame
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto.ticket import LeaseTicket

OPERATIONS = ("claim", "track", "done", "beat", "idle")
BEATS = 200
IDLE_STEPS = 2000
CONFIG = LeaseConfig(
    rate_limit_per_s=1e12,
    rate_limit_burst=1e12,
    max_ids_per_frame=10**6,
    max_leases_per_session=10**7,
)


def _entropy(seed: int) -> Callable[[int], bytes]:
    state = [seed * 1_000_000]

    def entropy(n: int) -> bytes:
        state[0] += 1
        return state[0].to_bytes(8, "big").rjust(n, b"\x01")[:n]

    return entropy


def _pair(leases: int) -> tuple[Holder, Reader, list[LeaseTicket]]:
    holder = Holder(CONFIG, engine="P", incarnation=1, entropy=_entropy(1))
    reader = Reader(CONFIG, engine="D", incarnation=2, entropy=_entropy(2))
    return holder, reader, [holder.grant(0.0, request_id=f"p{i}") for i in range(leases)]


def _pump(holder: Holder, reader: Reader, now: float, capture: list[bytes] | None = None) -> None:
    """Deliver every output both ways; with ``capture`` keep the reader's frames instead."""
    moved = True
    while moved:
        moved = False
        for out in reader.drain():
            moved = True
            if isinstance(out, Connect):
                reader.connected(now, engine=out.engine, rank=out.rank, peer="P0")
            elif isinstance(out, SendFrame):
                if capture is None:
                    holder.handle_frame(now, "D0", out.payload)
                else:
                    capture.append(out.payload)
        for h_out in holder.drain():
            moved = True
            if isinstance(h_out, SendFrame):
                reader.handle_frame(now, "P0", h_out.payload)


def _tracked(leases: int) -> tuple[Holder, Reader]:
    holder, reader, tickets = _pair(leases)
    for i, ticket in enumerate(tickets):
        reader.track(0.0, request_id=f"r{i}", ticket=ticket)
    _pump(holder, reader, 0.0)
    return holder, reader


def _deliver(holder: Holder, frames: list[tuple[float, bytes]]) -> Callable[[], None]:
    def run() -> None:
        for now, frame in frames:
            holder.handle_frame(now, "D0", frame)
            holder.drain()

    return run


def fixture(operation: str, leases: int) -> Callable[[], None]:
    """Build the fixture of ``operation``; the returned call runs it on every item."""
    if operation in ("claim", "track"):
        holder, reader, tickets = _pair(leases + 1)
        reader.track(0.0, request_id="first", ticket=tickets[0])
        _pump(holder, reader, 0.0)  # the session is open
        if operation == "track":

            def track() -> None:
                for i, ticket in enumerate(tickets[1:]):
                    reader.track(0.0, request_id=f"r{i}", ticket=ticket)

            return track
        for i, ticket in enumerate(tickets[1:]):
            reader.track(0.0, request_id=f"r{i}", ticket=ticket)
        due = reader.get_timer()
        assert due is not None
        reader.handle_timer(due)
        claims: list[bytes] = []
        _pump(holder, reader, 0.0, capture=claims)
        return _deliver(holder, [(0.0, frame) for frame in claims])
    if operation == "done":
        holder, reader = _tracked(leases)
        reader.handle_timer(1.0)
        _pump(holder, reader, 1.0)
        dones = []
        for i in range(leases):
            go = reader.begin_read(1.0, f"r{i}")
            assert isinstance(go, ReadGo), go
            dones += [(1.0, order.notify) for order in go.orders if order.notify]
        return _deliver(holder, dones)
    if operation == "beat":
        holder, reader = _tracked(leases)
        beats: list[tuple[float, bytes]] = []
        for k in range(1, BEATS + 1):
            now = k * CONFIG.heartbeat_interval
            reader.handle_timer(now)
            frames: list[bytes] = []
            _pump(holder, reader, now, capture=frames)
            beats += [(now, frame) for frame in frames]
        return _deliver(holder, beats)
    if operation == "idle":
        holder, reader = _tracked(leases)

        def idle() -> None:
            for _ in range(IDLE_STEPS):
                holder.handle_timer(0.5)
                holder.get_timer()
                reader.handle_timer(0.5)
                reader.get_timer()

        return idle
    raise ValueError(f"unknown operation {operation!r}")


def _items(operation: str, leases: int) -> int:
    return {"beat": BEATS, "idle": IDLE_STEPS}.get(operation, leases)


def _instructions(*args: str) -> int:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    valgrind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    out = subprocess.run(
        [*valgrind, sys.executable, __file__, *args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    found = re.search(r"Collected : (\d+)", out)
    if found is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{out}")
    return int(found.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Instructions per operation, by callgrind.")
    parser.add_argument("operations", nargs="*", help=f"some of {', '.join(OPERATIONS)}")
    parser.add_argument("--leases", type=int, default=300)
    parser.add_argument("--run", choices=["build", "all"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    operations = args.operations or list(OPERATIONS)
    unknown = sorted(set(operations) - set(OPERATIONS))
    if unknown:
        parser.error(f"unknown operation(s): {', '.join(unknown)}")
    gc.disable()
    if args.run is not None:  # one side of a count, under valgrind
        run = fixture(operations[0], args.leases)
        if args.run == "all":
            run()
        return 0
    import kvproto

    compileall.compile_dir(str(Path(kvproto.__file__).parent), quiet=1)
    for operation in operations:
        built = _instructions(operation, f"--leases={args.leases}", "--run=build")
        ran = _instructions(operation, f"--leases={args.leases}", "--run=all")
        per = (ran - built) / _items(operation, args.leases)
        print(f"{operation:6} {per:10,.0f} instructions per item ({args.leases} leases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
