"""A holder, an honest reader and a hostile second reader over a link that drops,
duplicates and reorders, driven by hypothesis; the safety invariants are checked after
every step (spec/invariants.md)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvproto import wire
from kvproto.config import LeaseConfig
from kvproto.events import (
    Connect,
    FreeBlocks,
    ReadConfirmed,
    ReadDeclined,
    ReadDeferred,
    ReadGo,
    ReleaseReason,
    RequestFailed,
    SendFrame,
)
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto.states import LeaseState, ReadState
from kvproto.ticket import LeaseTicket, claim_proof

from .pair import counter_entropy
from .rawsession import open_session

CONFIG = LeaseConfig(
    kv_lease_duration=30,
    decoder_kv_blocks_ttl=60,
    max_hold=90,  # small enough that max_hold is reached in a run
    tombstone_ttl=40,
    rate_limit_per_s=50.0,
    rate_limit_burst=60.0,
    max_notification_size=256,  # uccl's cap: splitting is exercised too
)
HOLDER, HOSTILE = "P-agent", "X-agent"
Key = tuple[str, str]
"""(reader peer, request id): one request as seen by one reader rank."""


@dataclass
class Transfer:
    holder_rank: int
    notify: bytes


@dataclass
class Tracked:
    ticket: LeaseTicket
    read_started: bool = False
    completed: bool = False
    ended: bool = False  # finished locally, failed or confirmed
    overlapped: bool = False  # a FreeBlocks for its lease came before its transfer completed
    transfers: list[Transfer] = field(default_factory=list)
    deferred_until: float | None = None  # the one deferral's bound, once deferred


class LeaseMachine(RuleBasedStateMachine):
    """One holder rank, ``READER_TP`` honest reader ranks of engine D, a hostile engine X."""

    READER_TP = 1

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.holder = Holder(CONFIG, engine="P", incarnation=7, entropy=counter_entropy(10))
        self.readers = {
            f"D{rank}-agent": Reader(
                CONFIG,
                engine="D",
                incarnation=9,
                rank=rank,
                tp_size=self.READER_TP,
                entropy=counter_entropy(20 + rank),
            )
            for rank in range(self.READER_TP)
        }
        self.link: list[tuple[str, str, bytes]] = []  # (src, dst, payload) in flight
        self.sniffed: list[bytes] = []  # everything D sent, as an on-path observer sees it
        self.sent_by: list[tuple[str, bytes]] = []  # (D rank's peer, frame) for network replays
        self.tickets: dict[int, LeaseTicket] = {}
        self.requests: dict[Key, Tracked] = {}
        self.freed: dict[int, tuple[float, ReleaseReason]] = {}
        self.ever_terminal: dict[int, LeaseState] = {}
        self.best_deadline: dict[int, float] = {}
        self.confirmed: set[Key] = set()
        self.failed: set[Key] = set()
        self.n = 0
        self.x_seq = 0
        # The hostile engine has a session of its own from the start, keyed by a ticket
        # of its own (a malicious peer engine is a customer too).
        x_anchor = self.holder.grant(self.now, request_id="x-own", ttl=CONFIG.max_hold)
        x_key = open_session(self.holder, x_anchor, HOSTILE, engine="X", incarnation=66)
        assert x_key is not None
        self.x_key = x_key
        self.x_anchor = x_anchor.lease
        self.collect()

    # ------------------------------------------------------------ plumbing

    def collect(self) -> None:
        for _ in range(100):
            moved = False
            for out in self.holder.drain():
                moved = True
                if isinstance(out, SendFrame):
                    if out.peer in self.readers:
                        self.link.append((HOLDER, out.peer, out.payload))
                elif isinstance(out, FreeBlocks):
                    self.on_free(out)
            for peer, reader in self.readers.items():
                for rout in reader.drain():
                    moved = True
                    self.on_reader_output(peer, reader, rout)
            if not moved:
                return
        raise AssertionError("outputs never settled")

    def on_reader_output(self, peer: str, reader: Reader, rout: object) -> None:
        if isinstance(rout, SendFrame):
            assert rout.peer == HOLDER
            assert len(rout.payload) <= 256, len(rout.payload)
            self.link.append((peer, HOLDER, rout.payload))
            self.sniffed.append(rout.payload)
            self.sent_by.append((peer, rout.payload))
        elif isinstance(rout, Connect):
            reader.connected(self.now, engine=rout.engine, rank=rout.rank, peer=HOLDER)
        elif isinstance(rout, RequestFailed):
            key = (peer, rout.request_id)
            assert key not in self.confirmed
            self.failed.add(key)
            self.requests[key].ended = True
        elif isinstance(rout, ReadConfirmed):
            key = (peer, rout.request_id)
            req = self.requests[key]
            assert not req.overlapped, f"{key} confirmed though freed mid-read"
            assert req.completed, f"{key} confirmed before its read completed"
            assert key not in self.failed
            self.confirmed.add(key)
            req.ended = True

    def on_free(self, f: FreeBlocks) -> None:
        assert f.lease not in self.freed, f"lease {f.lease} freed twice"
        self.freed[f.lease] = (self.now, f.reason)
        for (peer, rid), req in self.requests.items():
            if req.ticket.lease == f.lease and not req.completed:
                req.overlapped = True
                if f.reason is ReleaseReason.EXPIRED and not req.ended:
                    # The reader's conservative view never outlives the true expiry.
                    bound = self.readers[peer].deadline_bound(self.now, rid)
                    assert bound <= self.now + 1e-9, (peer, rid, bound)

    def deliver_frame(self, src: str, dst: str, payload: bytes) -> None:
        if dst == HOLDER:
            self.holder.handle_frame(self.now, src, payload)
        else:
            self.readers[dst].handle_frame(self.now, src, payload)
        self.collect()

    # ------------------------------------------------------------ rules: lifecycle

    @rule(ttl=st.sampled_from([None, None, 60.0]), track=st.booleans())
    def grant(self, ttl: float | None, track: bool) -> None:
        self.n += 1
        ticket = self.holder.grant(self.now, request_id=f"p{self.n}", ttl=ttl)
        self.tickets[ticket.lease] = ticket
        if track:
            rid = f"r{self.n}"
            for peer, reader in self.readers.items():
                self.requests[(peer, rid)] = Tracked(ticket)
                reader.track(self.now, request_id=rid, ticket=ticket)
        self.collect()

    def _unread(self) -> list[Key]:
        return sorted(k for k, r in self.requests.items() if not r.ended and not r.read_started)

    def _start(self, key: Key) -> ReadGo | None:
        peer, rid = key
        reader = self.readers[peer]
        if not reader.ready_to_read(rid):
            return None
        req = self.requests[key]
        req.read_started = True
        result = reader.begin_read(self.now, rid)
        self.collect()
        if isinstance(result, ReadDeferred):
            # One deferral per request: asking again repeats it, never starts a second one,
            # and nothing is deferred past its bound.
            assert req.deferred_until in (None, result.until), (key, result)
            assert self.now < result.until
            assert result.heartbeats == 0 or req.deferred_until is None
            req.deferred_until = result.until
            req.read_started = False  # asked again later, as a binding does
        elif isinstance(result, ReadDeclined) and req.deferred_until is not None:
            assert reader.stats.declined >= 1
        return result if isinstance(result, ReadGo) else None

    @precondition(lambda self: self._unread())
    @rule(data=st.data())
    def begin_read(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self._unread()))
        go = self._start(key)
        if go is not None:
            self.requests[key].transfers = [Transfer(o.holder_rank, o.notify) for o in go.orders]

    def _in_flight(self) -> list[Key]:
        return sorted(k for k, r in self.requests.items() if r.transfers and not r.completed)

    def _complete(self, key: Key, outcome: str) -> None:
        peer, rid = key
        req = self.requests[key]
        req.completed = True
        transfers, req.transfers = req.transfers, []
        for transfer in transfers:
            if outcome == "failed":
                self.readers[peer].read_failed(self.now, rid, transfer.holder_rank)
            else:
                if outcome == "done":  # the notification rides the READ: queued as it ends
                    self.link.append((peer, HOLDER, transfer.notify))
                    self.sniffed.append(transfer.notify)
                self.readers[peer].read_completed(self.now, rid, transfer.holder_rank)
            self.collect()

    @precondition(lambda self: self._in_flight())
    @rule(data=st.data(), outcome=st.sampled_from(["done", "done", "done_lost", "failed"]))
    def complete_transfer(self, data: st.DataObject, outcome: str) -> None:
        self._complete(data.draw(st.sampled_from(self._in_flight())), outcome)

    @precondition(lambda self: any(not r.ended for r in self.requests.values()))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(k for k, r in self.requests.items() if not r.ended)))
        req = self.requests[key]
        if req.read_started and not req.completed:
            return  # the binding waits for an issued read before it drops the request
        self.readers[key[0]].finish(self.now, key[1])
        req.ended = True
        self.collect()

    @precondition(lambda self: any(not s.terminal for s in self._states().values()))
    @rule(data=st.data(), really=st.integers(0, 3))
    def revoke(self, data: st.DataObject, really: int) -> None:
        if really:  # memory pressure is rarer than the rest
            return
        live = sorted(lease for lease, s in self._states().items() if not s.terminal)
        self.holder.revoke(self.now, data.draw(st.sampled_from(live)))
        self.collect()

    @rule(data=st.data(), side=st.sampled_from(["holder", "reader"]))
    def peer_lost(self, data: st.DataObject, side: str) -> None:
        peer = data.draw(st.sampled_from(sorted(self.readers)))
        if side == "holder":
            self.holder.peer_lost(self.now, peer)
        else:
            self.readers[peer].peer_lost(self.now, HOLDER)
        self.collect()

    # ------------------------------------------------------------ rules: time

    def _timers(self) -> None:
        self.holder.handle_timer(self.now)
        self.collect()
        for reader in self.readers.values():
            reader.handle_timer(self.now)
            self.collect()

    @rule(dt=st.sampled_from([0.01, 0.5, 1.0, 2.5, 5.0, 10.0, 21.0, 45.0]))
    def advance(self, dt: float) -> None:
        self.now += dt
        self._timers()

    @precondition(lambda self: self._unread())
    @rule(
        data=st.data(),
        dt=st.sampled_from([12.0, 15.5, 17.0, 19.0, 22.0, 35.0]),
        overdue_first=st.booleans(),
    )
    def stalled_read(self, data: st.DataObject, dt: float, overdue_first: bool) -> None:
        """The readers were in a long forward step (no timers); the step ends and a read is
        tried, with the overdue heartbeat sent first (the binding's order) or not."""
        self.now += dt
        self.holder.handle_timer(self.now)
        self.collect()
        if overdue_first:
            for reader in self.readers.values():
                reader.handle_timer(self.now)
                self.collect()
        if not self._unread():
            return  # never welcomed: the readers failed their lapsed requests themselves
        key = data.draw(st.sampled_from(self._unread()))
        go = self._start(key)
        if go is not None:
            self.requests[key].transfers = [Transfer(o.holder_rank, o.notify) for o in go.orders]

    @rule()
    def next_timer_exactly(self) -> None:
        cores: list[Holder | Reader] = [self.holder, *self.readers.values()]
        due = [t for t in (c.get_timer() for c in cores) if t is not None]
        if due:
            self.now = max(self.now, min(due))
            self._timers()

    # ------------------------------------------------------------ rules: the link

    @precondition(lambda self: self.link)
    @rule(i=st.integers(0, 10_000))
    def deliver(self, i: int) -> None:
        self.deliver_frame(*self.link.pop(i % len(self.link)))

    @precondition(lambda self: self.link)
    @rule(i=st.integers(0, 10_000))
    def deliver_in_order(self, i: int) -> None:
        for _ in range(min(len(self.link), 1 + i % 8)):
            self.deliver_frame(*self.link.pop(0))

    @rule()
    def settle(self) -> None:
        """A quiet network: everything in flight arrives, in order, until nothing moves."""
        for _ in range(400):
            if not self.link:
                return
            self.deliver_frame(*self.link.pop(0))

    @precondition(lambda self: self._unread())
    @rule(data=st.data(), delay=st.sampled_from([0.0, 0.0, 1.0, 4.0, 30.0]))
    def happy_read(self, data: st.DataObject, delay: float) -> None:
        """Settle, read, complete after ``delay``, settle: the common path, so that
        confirmations interleave with everything else."""
        self.settle()
        if not self._unread():
            return
        key = data.draw(st.sampled_from(self._unread()))
        go = self._start(key)
        if go is None:
            return
        self.requests[key].transfers = [Transfer(o.holder_rank, o.notify) for o in go.orders]
        self.advance(delay)
        if not self.requests[key].completed:
            self._complete(key, "done")
        self.settle()

    @precondition(lambda self: self.link)
    @rule(i=st.integers(0, 10_000))
    def drop(self, i: int) -> None:
        self.link.pop(i % len(self.link))

    @precondition(lambda self: self.link)
    @rule(i=st.integers(0, 10_000))
    def duplicate(self, i: int) -> None:
        self.link.append(self.link[i % len(self.link)])

    # ------------------------------------------------------------ rules: hostile reader

    @precondition(lambda self: self.tickets)
    @rule(
        data=st.data(),
        kind=st.sampled_from(["claim", "abort", "done"]),
        proof=st.sampled_from(["random", "sniffed", "own"]),
    )
    def hostile_forge(self, data: st.DataObject, kind: str, proof: str) -> None:
        lease = data.draw(st.sampled_from(sorted(self.tickets)))
        seen = self._sniffed_proofs().get(lease)
        value = {
            "random": data.draw(st.binary(min_size=16, max_size=16)),
            # D's proof, bound to engine D, if D ever sent it (X never sees the token).
            "sniffed": seen or data.draw(st.binary(min_size=16, max_size=16)),
            "own": claim_proof(bytes(16), "X", lease),  # a guess without the token
        }[proof]
        c = wire.Claim(lease=lease, proof=value)
        if kind == "done":
            msg: wire.Message = wire.Done(claim=c)
        else:
            self.x_seq += 1
            msg = wire.Heartbeat(
                seq=self.x_seq,
                claims=[c] if kind == "claim" else [],
                aborts=[c] if kind == "abort" else [],
                count=0,
                digest=0,
            )
        self.holder.handle_frame(self.now, HOSTILE, wire.encode(msg, self.x_key))
        self.collect()

    def _holder_view(self) -> tuple[object, ...]:
        h = self.holder
        live = {
            lease: (state, h.deadline(lease))
            for lease, state in self._states().items()
            if not state.terminal
        }
        s = h.stats
        return (
            live,
            s.heartbeats,
            s.done_frames,
            s.claims,
            s.aborted,
            h.stats_snapshot()["sessions"],
        )

    @rule(
        data=st.data(),
        kind=st.sampled_from(["empty", "claim", "abort", "done", "resync", "hello"]),
        seq=st.sampled_from([1, 2, 10**6, 2**62, 2**64 - 1]),
        key=st.sampled_from([None, bytes(16), b"g" * 16]),
    )
    def forge_under_d_name(
        self, data: st.DataObject, kind: str, seq: int, key: bytes | None
    ) -> None:
        """X sends under a D rank's own transport name, without any ticket:
        no claims (count=0, digest=0), sniffed proofs, seq jumps, anchorless Hellos.
        Nothing may change: not a state, not a deadline, not a counter of applied frames."""
        peer = data.draw(st.sampled_from(sorted(self.readers)))
        proofs = self._sniffed_proofs()
        lease = data.draw(st.sampled_from(sorted(self.tickets))) if self.tickets else 1
        c = wire.Claim(lease=lease, proof=proofs.get(lease, bytes(16)))
        msg: wire.Message
        if kind == "done":
            msg = wire.Done(claim=c)
        elif kind == "hello":
            msg = wire.Hello(
                engine="D", rank=0, tp_size=1, incarnation=1234, nonce=bytes(16), anchor=c
            )
        else:
            msg = wire.Heartbeat(
                seq=seq,
                claims=[c] if kind == "claim" else [],
                aborts=[c] if kind == "abort" else [],
                count=0,
                digest=0,
                full=[] if kind == "resync" else None,
            )
        before = self._holder_view()
        self.holder.handle_frame(self.now, peer, wire.encode(msg, key))
        assert self._holder_view() == before
        self.collect()

    @rule(
        data=st.data(),
        kind=st.sampled_from(["held", "late", "revoke", "reject", "no_session"]),
        key=st.sampled_from([None, b"g" * 16]),
    )
    def forge_to_reader(self, data: st.DataObject, kind: str, key: bytes | None) -> None:
        """X forges the holder's answers to a D rank. A HELD trusted here would show up as
        a confirmed read overlapping a free (the invariants below)."""
        peer = data.draw(st.sampled_from(sorted(self.readers)))
        lease = data.draw(st.sampled_from(sorted(self.tickets))) if self.tickets else 1
        msg: wire.Message = {
            "held": wire.DoneAck(lease=lease, verdict=wire.DoneVerdict.HELD, proof=bytes(16)),
            "late": wire.DoneAck(lease=lease, verdict=wire.DoneVerdict.LATE),
            "revoke": wire.Revoke(leases=[lease], reason=4),
            "reject": wire.Reject(reason=wire.RejectReason.TOO_MANY),
            "no_session": wire.Reject(reason=wire.RejectReason.NO_SESSION, seq=1),
        }[kind]
        reader = self.readers[peer]
        failed = reader.stats.snapshot()
        reader.handle_frame(self.now, HOLDER, wire.encode(msg, key))
        if kind != "no_session":  # heeded at most once an interval, costs one Hello
            assert list(reader.drain()) == []
            assert reader.stats.reads_confirmed == failed["reads_confirmed"]
        self.collect()

    def _sniffed_proofs(self) -> dict[int, bytes]:
        proofs: dict[int, bytes] = {}
        for payload in self.sniffed:
            msg = wire.decode(payload)
            claims = (
                [msg.claim]
                if isinstance(msg, wire.Done)
                else [*msg.claims, *msg.aborts]
                if isinstance(msg, wire.Heartbeat)
                else []
            )
            proofs.update((c.lease, c.proof) for c in claims)
        return proofs

    @precondition(lambda self: self.sniffed)
    @rule(i=st.integers(0, 10_000))
    def hostile_replay(self, i: int) -> None:
        """X replays D's frames on its own channel: proofs bound to engine D are useless to
        X, and so is D's Hello (its session key needs the anchor ticket's token)."""
        payload = self.sniffed[i % len(self.sniffed)]
        self.holder.handle_frame(self.now, HOSTILE, payload)
        self.collect()

    @precondition(lambda self: self.sent_by)
    @rule(i=st.integers(0, 10_000))
    def network_replay(self, i: int) -> None:
        """An old frame of a D rank arrives again on that rank's own channel, any time later."""
        peer, payload = self.sent_by[i % len(self.sent_by)]
        self.holder.handle_frame(self.now, peer, payload)
        self.collect()

    @rule(data=st.binary(max_size=64))
    def hostile_garbage(self, data: bytes) -> None:
        self.holder.handle_frame(self.now, HOSTILE, data)
        for reader in self.readers.values():
            reader.handle_frame(self.now, HOLDER, data)  # junk on the holder's channel too
        self.collect()

    # ------------------------------------------------------------ invariants

    def _states(self) -> dict[int, LeaseState]:
        out = {}
        for lease in self.tickets:
            state = self.holder.lease_state(lease)
            if state is not None:
                out[lease] = state
        return out

    @invariant()
    def no_resurrection_and_one_free_per_lease(self) -> None:
        for lease, state in self._states().items():
            if lease in self.ever_terminal:
                assert state is self.ever_terminal[lease], (lease, state)
            elif state.terminal:
                self.ever_terminal[lease] = state
                assert lease in self.freed, f"lease {lease} ended without FreeBlocks"
            else:
                assert lease not in self.freed, f"lease {lease} freed but {state}"

    @invariant()
    def deadlines_never_decrease(self) -> None:
        for lease, state in self._states().items():
            if state.terminal:
                continue
            d = self.holder.deadline(lease)
            assert d >= self.best_deadline.get(lease, -math.inf), (lease, d)
            self.best_deadline[lease] = d
            assert d > self.now or self.holder.get_timer() is not None

    @invariant()
    def live_gauge_matches(self) -> None:
        states = list(self._states().values())
        snap = self.holder.stats_snapshot()
        # X's own anchor lease (granted for max_hold, never claimed) is live beside D's.
        x_live = self.holder.lease_state(self.x_anchor) is LeaseState.GRANTED
        assert self.holder.live_leases() == sum(not s.terminal for s in states) + x_live
        assert snap["leases_granted"] == sum(s is LeaseState.GRANTED for s in states) + x_live
        assert snap["leases_held"] == sum(s is LeaseState.HELD for s in states)
        assert self.holder.live_leases() == snap["leases_granted"] + snap["leases_held"]

    @invariant()
    def reader_bound_below_true_deadline(self) -> None:
        for (peer, rid), req in self.requests.items():
            if req.ended:
                continue
            state = self.holder.lease_state(req.ticket.lease)
            if state is None or state.terminal:
                continue
            reader = self.readers[peer]
            states = reader.state(rid).values()
            if ReadState.FAILED in states:
                continue
            # A deferred request is in DEFERRED until it goes, fails or finishes.
            if req.deferred_until is not None and not req.read_started:
                assert all(s is ReadState.DEFERRED for s in states), (peer, rid, states)
            bound = reader.deadline_bound(self.now, rid)
            assert bound <= self.holder.deadline(req.ticket.lease) + 1e-9, (peer, rid)

    @invariant()
    def confirmed_reads_never_overlapped_a_free(self) -> None:
        for key in self.confirmed:
            assert not self.requests[key].overlapped

    @invariant()
    def released_only_after_every_consumer(self) -> None:
        """S5: DONE needs a completed read from every reader rank (TP layouts at Hello)."""
        for lease, (_, reason) in self.freed.items():
            if reason is ReleaseReason.DONE:
                readers = [r for (_, _), r in self.requests.items() if r.ticket.lease == lease]
                assert len(readers) == self.READER_TP
                assert all(r.completed for r in readers), lease

    @invariant()
    def no_done_is_taken_for_another_tp_layout(self) -> None:
        """Every session here has one TP layout per engine, so ``bad_rank_done`` is never
        right: a done that overtakes its claim claims, one after the end is LATE."""
        assert self.holder.stats.bad_rank_done == 0


SETTINGS = {
    "stateful_step_count": 60,
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
}
# KVPROTO_STATEFUL_EXAMPLES=5000 for a long bug hunt; the default keeps CI fast.
EXAMPLES = int(os.environ.get("KVPROTO_STATEFUL_EXAMPLES", "80"))
LeaseMachine.TestCase.settings = settings(max_examples=EXAMPLES, **SETTINGS)
TestLeaseMachine = LeaseMachine.TestCase


class TwoReaderRanksMachine(LeaseMachine):
    """Holder TP 1, reader TP 2: every lease needs two distinct consumers, and is held
    by two sessions of one engine (partial dones, one rank lost, duplicates)."""

    READER_TP = 2


TwoReaderRanksMachine.TestCase.settings = settings(max_examples=EXAMPLES // 2, **SETTINGS)
TestTwoReaderRanksMachine = TwoReaderRanksMachine.TestCase
