"""Shared pieces of the fuzz targets: a holder and a reader mid-conversation, state
snapshots that must not move on invalid input, and seed inputs for each parser.

Import this inside ``atheris.instrument_imports()`` so that kvproto is instrumented.
"""

from __future__ import annotations

import array
import collections
import copy
import enum
import inspect
import json
from typing import Any

from kvproto import auth, legacy, wire
from kvproto.config import LeaseConfig
from kvproto.events import ReadGo, SendFrame
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto.ticket import LeaseTicket, claim_proof

KEY = b"k" * 32
# No rate limit: the fuzzer sends millions of frames at one instant.
CONFIG = LeaseConfig(rate_limit_per_s=1e12, rate_limit_burst=1e12)
LEGACY_CONFIG = LeaseConfig(rate_limit_per_s=1e12, rate_limit_burst=1e12, accept_legacy=True)


class Pair:
    """A holder P (peer "P0") and a reader D (peer "D0") with three leases held, one
    read in flight, built by running the real exchange."""

    def __init__(self, config: LeaseConfig = CONFIG) -> None:
        self.holder = Holder(config, engine="P", incarnation=7, entropy=_counter(1))
        self.reader = Reader(config, engine="D", incarnation=9, entropy=_counter(2))
        self.tickets = [self.holder.grant(0.0, request_id=f"p{i}") for i in range(3)]
        self.frames: list[bytes] = []
        for i, t in enumerate(self.tickets):
            self.reader.track(0.0, request_id=f"r{i}", ticket=t)
        self.pump(0.0)
        self.reader.handle_timer(5.0)
        self.pump(5.0)
        go = self.reader.begin_read(5.0, "r0")
        assert isinstance(go, ReadGo)
        self.frames.extend(o.notify for o in go.orders)
        self.pump(5.0)

    def pump(self, now: float) -> None:
        for _ in range(50):
            moved = False
            for r_out in self.reader.drain():
                moved = True
                if isinstance(r_out, SendFrame):
                    self.frames.append(r_out.payload)
                    self.holder.handle_frame(now, "D0", r_out.payload)
                elif hasattr(r_out, "engine"):  # Connect
                    self.reader.connected(now, engine="P", rank=0, peer="P0")
            for h_out in self.holder.drain():
                moved = True
                if isinstance(h_out, SendFrame):
                    self.frames.append(h_out.payload)
                    self.reader.handle_frame(now, "P0", h_out.payload)
            if not moved:
                return

    def session_keys(self) -> list[bytes]:
        """Every key a frame may be signed with to be authentic here (both directions)."""
        keys: list[bytes] = []
        for hs in self.holder._sessions.values():
            keys += [hs.up, hs.prev_up]
        for rs in self.reader._sessions.values():
            keys += [rs.down, rs.prev_down]
        return [k for k in keys if k]

    def authentic(self, data: bytes) -> bool:
        """Signed with one of this pair's session keys (the fuzzer cannot forge one)."""
        return any(wire.verify(k, data) for k in self.session_keys())

    def anchored(self, hello: wire.Hello) -> bool:
        """The Hello's anchor proof is right for a lease this holder holds."""
        anchor = hello.anchor
        table = self.holder._leases
        slot = None if anchor is None else table.slot(anchor.lease)
        if anchor is None or slot is None:
            return False
        proof = auth.hello_proof(
            table.token(slot),
            reader_engine=hello.engine,
            reader_rank=hello.rank,
            reader_tp=hello.tp_size,
            reader_incarnation=hello.incarnation,
            holder_rank=self.holder.rank,
            lease=anchor.lease,
            attempt=hello.attempt,
            nonce=hello.nonce,
        )
        return proof == anchor.proof

    def copy(self) -> Pair:
        return copy.deepcopy(self)

    def snapshot(self) -> Any:
        """Every piece of lease, request and session state of both cores (counters excluded).

        Walked generically over the cores' attributes (slots, dataclass and msgspec
        fields, containers), so it follows the cores when their internals change: a
        hand-written list of fields went stale twice. Counters, token buckets, the
        replay window's bookkeeping of *accepted* frames and the reader's cached
        timer answer are left out (:data:`NOT_STATE`): invalid input may bump a
        counter, spend a rate-limit token and make the reader look at its timers
        again, nothing else.
        """
        return state_of(self.holder), state_of(self.reader)


NOT_STATE = frozenset({"stats", "_stats", "counters", "bucket", "_buckets", "window", "_wake"})
"""Attribute names :meth:`Pair.snapshot` skips (see its docstring)."""


def state_of(obj: Any) -> Any:
    """A hashable, comparable picture of ``obj`` and everything it holds."""
    return _walk(obj, {})


def _walk(obj: Any, seen: dict[int, int]) -> Any:
    if obj is None or isinstance(obj, (bool, int, str, bytes, enum.Enum)):
        return obj
    if isinstance(obj, float):
        return obj.hex()  # NaN (an unscheduled deadline) equals itself this way
    if isinstance(obj, (bytearray, array.array)):
        return bytes(obj) if isinstance(obj, bytearray) else obj.tobytes()
    if callable(obj) and not hasattr(obj, "__slots__") and not hasattr(obj, "__dict__"):
        return "<callable>"
    if id(obj) in seen:
        return ("<seen>", seen[id(obj)])  # shared or cyclic: refer to the first visit
    seen[id(obj)] = len(seen)
    if isinstance(obj, (list, tuple, collections.deque)):
        return tuple(_walk(x, seen) for x in obj)
    if isinstance(obj, (set, frozenset)):
        return frozenset(_walk(x, seen) for x in obj)
    if isinstance(obj, dict):
        return tuple((_walk(k, seen), _walk(v, seen)) for k, v in obj.items())
    if inspect.isfunction(obj) or inspect.ismethod(obj):
        return "<callable>"
    names: list[str] = []
    fields = getattr(type(obj), "__struct_fields__", ())  # msgspec Structs
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += [n for n in ((slots,) if isinstance(slots, str) else slots) if n not in names]
    names += [n for n in (fields if isinstance(fields, tuple) else ()) if n not in names]
    names += [n for n in getattr(obj, "__dict__", {}) if n not in names]
    return (
        type(obj).__name__,
        tuple(
            (n, _walk(getattr(obj, n), seen))
            for n in names
            if n not in NOT_STATE and not n.startswith("__") and hasattr(obj, n)
        ),
    )


class Rolling:
    """The pair a target feeds: valid frames may change it (that is their job), so it
    rolls on from there and is replaced by a fresh copy of the template every
    ``every`` accepted inputs, to keep exploring from a mid-conversation state."""

    def __init__(self, template: Pair, every: int = 200) -> None:
        self.template = template
        self.every = every
        self.work = template.copy()
        self.accepted = 0

    def note_accepted(self) -> None:
        self.accepted += 1
        if self.accepted >= self.every:
            self.work, self.accepted = self.template.copy(), 0


def _counter(seed: int) -> Any:
    state = [seed * 1_000_000]

    def entropy(n: int) -> bytes:
        state[0] += 1
        return state[0].to_bytes(8, "big").rjust(n, b"\x01")[:n]

    return entropy


def wire_seeds(pair: Pair) -> list[bytes]:
    t = pair.tickets[0]
    proof = claim_proof(t.token, "D", t.lease)
    extra: list[wire.Message] = [
        wire.Heartbeat(
            seq=99,
            claims=[wire.Claim(lease=t.lease, proof=proof)],
            aborts=[wire.Claim(lease=2, proof=proof)],
            count=3,
            digest=wire.digest([1, 2, 3]),
            full=[1, 1, 1],
        ),
        wire.Revoke(leases=[1, 2], reason=4),
        wire.Reject(reason=1, seq=3),
        wire.DoneAck(lease=1, verdict=1),
        wire.Arm(claim=wire.Claim(lease=t.lease, proof=proof)),
        wire.ArmAck(lease=t.lease, armed=True, left=3.5),
    ]
    seeds = list(pair.frames) + [wire.encode(m) for m in extra]
    seeds += [wire.encode(m, KEY) for m in extra]
    # Signed with the live session keys: frames the cores act on, to mutate.
    up = pair.holder._sessions["D0"].up
    down = pair.reader._sessions[("P", 0)].down
    to_holder = (wire.Heartbeat, wire.Done, wire.Arm)
    seeds += [wire.encode(m, up) for m in extra if isinstance(m, to_holder)]
    seeds += [wire.encode(m, down) for m in extra if not isinstance(m, wire.Heartbeat)]
    return seeds


def legacy_seeds() -> list[bytes]:
    return [
        legacy.encode_heartbeat(["p0", "p1", "p2"]),
        legacy.encode_heartbeat([]),
        legacy.encode_done("p0", 1),
        legacy.encode_done("chat:cmpl:1", 2),
        b"p1:65536",
    ]


def ticket_seeds(pair: Pair) -> list[bytes]:
    out = []
    for t in pair.tickets:
        out.append(json.dumps(t.to_params()).encode())
    bad = dict(pair.tickets[0].to_params())
    bad["lease"] = 2**64
    out.append(json.dumps(bad).encode())
    return out


def write_seeds(directory: str, seeds: list[bytes]) -> None:
    """One file per seed input, as libFuzzer reads a corpus directory."""
    for i, data in enumerate(seeds):
        with open(f"{directory}/seed-{i:03d}", "wb") as f:
            f.write(data)


def ticket_from_json(data: bytes) -> Any:
    """The fuzzer's bytes as JSON (what kv_transfer_params carry); None if not JSON."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


__all__ = [
    "CONFIG",
    "KEY",
    "LEGACY_CONFIG",
    "LeaseTicket",
    "Pair",
    "Rolling",
    "legacy_seeds",
    "ticket_from_json",
    "ticket_seeds",
    "wire_seeds",
    "write_seeds",
]
