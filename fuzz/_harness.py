"""Shared pieces of the fuzz targets: a holder and a reader mid-conversation, state
snapshots that must not move on invalid input, and seed inputs for each parser.

Import this inside ``atheris.instrument_imports()`` so that kvproto is instrumented.
"""

from __future__ import annotations

import copy
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
        lease = None if anchor is None else self.holder._leases.get(anchor.lease)
        if anchor is None or lease is None:
            return False
        proof = auth.hello_proof(
            lease.token,
            reader_engine=hello.engine,
            reader_rank=hello.rank,
            reader_tp=hello.tp_size,
            reader_incarnation=hello.incarnation,
            holder_rank=self.holder.rank,
            lease=lease.lease,
            attempt=hello.attempt,
            nonce=hello.nonce,
        )
        return proof == anchor.proof

    def copy(self) -> Pair:
        return copy.deepcopy(self)

    def snapshot(self) -> Any:
        """Every piece of lease, request and session state (counters excluded).

        Read straight from the cores' internals (update this when they change): the
        fuzzer calls this twice per input, and going through the public queries
        (instrumented, and building dicts) cost more than the input itself. Counters,
        token buckets and the replay window's bookkeeping of *accepted* frames are
        deliberately left out: invalid input may bump a counter and spend a rate-limit
        token, nothing else.
        """
        h, r = self.holder, self.reader
        leases = tuple(
            (
                lease.state,
                lease.own_deadline,
                lease.hard_deadline,
                lease.owner,
                lease.expected,
                tuple(sorted((lease.consumers or {}).items())),  # None when empty
                tuple(sorted(s.serial for s in lease.sessions)),
            )
            for lease in h._leases.values()
        )
        sessions = tuple(
            (
                peer,
                s.serial,
                s.engine,
                s.deadline,
                s.count,
                s.digest,
                s.up,
                s.down,
                s.attempt,
                sorted(s.leases),
            )
            for peer, s in h._sessions.items()
        )
        requests = tuple(
            (
                rid,
                req.failed,
                req.confirmed,
                tuple(
                    (p.rank, p.state, p.lower_bound, p.claimed_seq, p.early_held, p.ack_deadline)
                    for p in req.parts.values()
                ),
            )
            for rid, req in r._requests.items()
        )
        r_sessions = tuple(
            (
                key,
                s.state,
                s.peer,
                s.up,
                s.down,
                s.nonce,
                s.incarnation,
                s.seq,
                s.next_beat,
                s.count,
                s.digest,
                tuple(s.pending_claims),
                tuple(s.pending_aborts),
                s.want_full,
                s.in_sync_seq,
                s.in_sync_since,
            )
            for key, s in r._sessions.items()
        )
        return leases, sessions, len(h._lease_heap), requests, r_sessions, len(r._out), len(h._out)


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
    ]
    seeds = list(pair.frames) + [wire.encode(m) for m in extra]
    seeds += [wire.encode(m, KEY) for m in extra]
    # Signed with the live session keys (issue 16): frames the cores act on, to mutate.
    up = pair.holder._sessions["D0"].up
    down = pair.reader._sessions[("P", 0)].down
    seeds += [wire.encode(m, up) for m in extra if isinstance(m, (wire.Heartbeat, wire.Done))]
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
