"""A holder and a reader end to end, with exact times (default config: 30 s lease,
5 s interval, 20 s extension, 20 s claim window, 5 s read margin, 5 s ack timeout,
2 done retries)."""

from __future__ import annotations

import pytest

from kvproto import wire
from kvproto.config import LeaseConfig
from kvproto.errors import LocalProtocolError
from kvproto.events import FailReason, ReadDeclined, ReadDeferred, ReadGo
from kvproto.holder import Holder
from kvproto.states import LeaseState, ReadState, SessionState
from kvproto_transports.loopback import LinkFaults

from .net import Net

DURATION, INTERVAL, EXTENSION, GRANT_TTL = 30.0, 5.0, 20.0, 20.0


def one_pair(config: LeaseConfig | None = None, *, latency: float = 0.0) -> Net:
    net = Net(config)
    net.add_holder("P0")
    net.add_reader("D0")
    net.links.default = LinkFaults(delay=latency)
    return net


def granted(net: Net, rid: str = "r1", *, ttl: float | None = None, reader: str = "D0") -> int:
    ticket = net.grant("P0", "p-" + rid, ttl=ttl)
    net.track(reader, rid, ticket)
    return ticket.lease


def test_normal_flow_exact_times() -> None:
    net = one_pair()
    lease = granted(net)
    h = net.holder("P0")
    assert h.deadline(lease) == GRANT_TTL  # the grant's own deadline (the claim window)
    net.run_until(22.0)
    # Heartbeats: at Welcome (t=0, vLLM dropped this one), then every interval.
    assert net.arrivals("D0", "P0", wire.Heartbeat) == [0.0, 5.0, 10.0, 15.0, 20.0]
    # Renewal is max(old, arrival + extension): 20 from the claim at 0, then 25 ... 40.
    assert h.deadline(lease) == 20.0 + EXTENSION
    assert h.lease_state(lease) is LeaseState.HELD
    assert net.reader("D0").state("r1") == {0: ReadState.CLAIMED}
    go = net.start_read("D0", "r1")
    assert isinstance(go, ReadGo) and len(go.orders) == 1
    net.run_until(22.0)
    assert net.freed_leases() == [(22.0, lease, "DONE")]
    assert [(t, rid) for t, _, rid in net.confirmed] == [(22.0, "r1")]
    assert net.failed == []
    assert net.arrivals("P0", "D0", wire.DoneAck) == [22.0]
    assert net.reader("D0").state("r1") == {0: ReadState.CONFIRMED}
    # Nothing is left to renew: at most the already scheduled tick follows the read.
    net.run_until(200.0)
    assert net.arrivals("D0", "P0", wire.Heartbeat)[5:] == [25.0]
    stats = h.stats_snapshot()
    assert stats["released_done"] == 1 and stats["leases_held"] == 0
    assert stats["heartbeats"] == 6
    net.check_no_silent_overlap()


def test_reader_snapshot_counts_its_tables_and_empties_when_the_request_leaves() -> None:
    net = one_pair()
    granted(net)
    net.run_until(1.0)
    r = net.reader("D0")
    snap = r.stats_snapshot("reader_")
    assert (snap["reader_requests"], snap["reader_sessions"]) == (1, 1)
    assert snap["reader_tracked"] == 1  # a counter beside the table sizes
    net.start_read("D0", "r1")
    net.run_until(2.0)
    net.finish("D0", "r1")
    net.run_until(3.0)
    snap = r.stats_snapshot("reader_")
    # The session stays for the next request to that holder; the request is gone.
    assert (snap["reader_requests"], snap["reader_sessions"]) == (0, 1)


def test_deadline_tracks_each_heartbeat_arrival_with_latency() -> None:
    net = one_pair(latency=0.25)
    lease = granted(net)
    h = net.holder("P0")
    # Hello at 0 arrives 0.25, Welcome back at 0.5, first heartbeat arrives 0.75.
    net.run_until(30.0)
    arrivals = net.arrivals("D0", "P0", wire.Heartbeat)
    assert arrivals == [0.75, 5.75, 10.75, 15.75, 20.75, 25.75]
    assert h.deadline(lease) == 25.75 + EXTENSION


@pytest.mark.parametrize("crash_at", [3.0, 12.0, 23.0, 47.0])
def test_reader_crash_frees_at_last_heartbeat_plus_extension(crash_at: float) -> None:
    net = one_pair()
    lease = granted(net)
    net.run_until(crash_at)
    last_beat = net.arrivals("D0", "P0", wire.Heartbeat)[-1]
    net.crash("D0")
    net.run_until(500.0)
    expected = max(GRANT_TTL, last_beat + EXTENSION)
    assert net.freed_leases() == [(expected, lease, "EXPIRED")]
    # Liveness bound: within extension + one tick of the crash (or the grant's own lease).
    assert expected <= max(GRANT_TTL, crash_at + EXTENSION + INTERVAL)
    assert net.holder("P0").live_leases() == 0


def test_overload_ten_leases_long_queue_never_freed_then_read_succeeds() -> None:
    net = one_pair()
    lease = granted(net)
    h = net.holder("P0")
    for t in range(10, 301, 10):
        net.run_until(float(t))
        assert h.lease_state(lease) is LeaseState.HELD
        assert h.deadline(lease) >= t + EXTENSION - INTERVAL
    assert net.freed == []
    assert net.reader("D0").begin_read is not None
    go = net.start_read("D0", "r1", duration=0.5)
    assert isinstance(go, ReadGo)
    net.run_until(301.0)
    assert net.freed_leases() == [(300.5, lease, "DONE")]
    assert [rid for _, _, rid in net.confirmed] == ["r1"]
    net.check_no_silent_overlap()


def test_long_forward_pass_lapses_lease_and_late_read_is_fenced() -> None:
    net = one_pair()
    lease = granted(net)
    net.run_until(20.5)  # last heartbeat arrived at 20: deadline 40
    go = net.start_read("D0", "r1", duration=24.5)  # the READ ends at 45
    assert isinstance(go, ReadGo)
    net.pause("D0", 70.0)  # the engine step holding the read runs 50 s: no heartbeats
    net.run_until(44.9)
    assert net.freed_leases() == [(40.0, lease, "EXPIRED")]
    net.run_until(100.0)
    # The done reached the holder at 45, after the free: answered LATE at once; the
    # paused reader sees the verdict when its step ends.
    acks = [(t, wire.decode(p)) for t, src, _, p in net.sent if src == "P0"]
    assert [(t, m) for t, m in acks if isinstance(m, wire.DoneAck)] == [
        (45.0, wire.DoneAck(lease=lease, verdict=wire.DoneVerdict.LATE))
    ]
    assert net.failures("D0") == [(70.0, "r1", "FENCED_LATE")]
    assert net.confirmed == []
    assert net.holder("P0").stats.late_done == 1
    assert net.reader("D0").stats.fenced == 1
    net.check_no_silent_overlap()


def test_read_after_stalled_heartbeats_is_declined_before_it_starts() -> None:
    net = one_pair()
    lease = granted(net)
    net.run_until(21.0)
    net.pause("D0", 60.0)
    net.run_until(60.0)
    assert net.freed_leases() == [(40.0, lease, "EXPIRED")]
    result = net.start_read("D0", "r1")
    assert result == ReadDeclined(reason=FailReason.DEADLINE_TOO_CLOSE)
    assert net.failures("D0")[0][2] in ("DEADLINE_TOO_CLOSE", "LEASE_LOST")
    assert net.transfers == []


def test_read_declined_within_read_margin_of_known_deadline() -> None:
    net = one_pair(latency=0.1)
    granted(net)
    net.run_until(20.2)  # heartbeat sent at 20.2, acknowledged at 20.4
    net.pause("D0", 35.0)  # bound: 20.2 + 20 * (1 - 500 ppm) = 40.19
    net.run_until(35.0)  # the step ends: a heartbeat leaves now, its ack is not back yet
    r = net.reader("D0")
    assert r.deadline_bound(net.local("D0"), "r1") == pytest.approx(40.19)
    assert net.holder("P0").deadline(1) == pytest.approx(40.3)  # the true one, later
    # 35 + 5 < 40.19: still safe to start now ...
    assert r.deadline_bound(35.0, "r1") > 35.0 + 5.0
    # ... but not 0.2 s later without a fresher acknowledgement: the bound is stale, not the
    # lease, so the reader heartbeats at once and defers the decision by up to ack_timeout ...
    net.nodes["D0"].last_local = 35.2
    assert net.start_read("D0", "r1") == ReadDeferred(until=40.2, heartbeats=1)
    # ... and reads once the answers are in (the heartbeat sent at 35.0 already moves the bound).
    net.run_until(35.5)
    assert r.deadline_bound(net.local("D0"), "r1") > net.local("D0") + 5.0
    assert isinstance(net.start_read("D0", "r1"), ReadGo)


def test_duplicated_done_never_frees_early_with_two_consumers() -> None:
    net = Net()
    net.add_holder("P0")  # holder TP 1
    net.add_reader("D0", rank=0, tp_size=2)
    net.add_reader("D1", rank=1, tp_size=2)
    ticket = net.grant("P0", "p-r1")
    net.track("D0", "r1", ticket)
    net.track("D1", "r1", ticket)
    net.run_until(6.0)
    go = net.start_read("D0", "r1")
    assert isinstance(go, ReadGo)
    net.run_until(6.0)
    notify = go.orders[0].notify
    for _ in range(3):  # the network duplicates rank 0's done
        net.holder("P0").handle_frame(6.0, "D0", notify)
    net.collect()
    h = net.holder("P0")
    assert h.lease_state(ticket.lease) is LeaseState.HELD
    assert net.freed == []
    assert h.stats.duplicate_done == 3
    net.run_until(30.0)
    assert net.freed == []  # rank 1 still heartbeats it
    net.start_read("D1", "r1")
    net.run_until(31.0)
    assert net.freed_leases() == [(30.0, ticket.lease, "DONE")]
    assert sorted(r for _, r, _ in net.confirmed) == ["D0", "D1"]
    net.check_no_silent_overlap()


def test_lost_done_ack_is_recovered_by_resending_the_done() -> None:
    net = one_pair()
    lease = granted(net)
    net.run_until(7.0)
    dropped: list[float] = []

    def drop_first_done_ack(src: str, dst: str, payload: bytes) -> bool:
        if isinstance(wire.decode(payload), wire.DoneAck) and not dropped:
            dropped.append(net.now)
            return False
        return True

    net.frame_filter = drop_first_done_ack
    net.start_read("D0", "r1", duration=1.0)
    net.run_until(20.0)
    assert dropped == [8.0]
    assert net.freed_leases() == [(8.0, lease, "DONE")]
    # Resent after ack_timeout / (done_retries + 1) = 5/3 s; the duplicate is answered HELD.
    assert net.arrivals("P0", "D0", wire.DoneAck) == [pytest.approx(8.0 + 5.0 / 3)]
    assert [(t, rid) for t, _, rid in net.confirmed] == [(pytest.approx(8.0 + 5.0 / 3), "r1")]
    assert net.reader("D0").stats.done_resent == 1
    assert net.holder("P0").stats.duplicate_done == 1


def test_all_done_frames_lost_fences_without_ack() -> None:
    net = one_pair()
    lease = granted(net)
    net.run_until(7.0)
    net.frame_filter = lambda s, d, p: not isinstance(wire.decode(p), wire.Done)
    net.start_read("D0", "r1", duration=1.0, lose_done=True)
    net.run_until(30.0)
    assert net.failures("D0") == [(13.0, "r1", "FENCED_NO_ACK")]
    assert net.reader("D0").stats.done_resent == 2
    assert net.confirmed == []
    # The reader gave the lease up; the holder frees it at once.
    assert net.freed_leases() == [(13.0, lease, "ABORTED")]


def test_lost_heartbeats_within_margin_keep_the_lease() -> None:
    """Two lost in a row, right after the claim and later: the gap (3 intervals) stays
    under the extension (spec/timing.md: a fourth tick would arrive at the deadline)."""
    net = one_pair()
    lease = granted(net)
    beats = []

    def drop_two_twice(src: str, dst: str, payload: bytes) -> bool:
        if isinstance(wire.decode(payload), wire.Heartbeat):
            beats.append(net.now)
            return net.now not in (5.0, 10.0, 25.0, 30.0)
        return True

    net.frame_filter = drop_two_twice
    net.run_until(60.0)
    assert net.freed == []
    assert net.holder("P0").deadline(lease) == 60.0 + EXTENSION


def test_lost_heartbeats_beyond_margin_expire_and_reader_learns() -> None:
    net = one_pair()
    lease = granted(net)
    net.frame_filter = lambda s, d, p: (
        not (isinstance(wire.decode(p), wire.Heartbeat) and 5.0 <= net.now <= 25.0)
    )
    net.run_until(40.0)
    assert net.freed_leases() == [(20.0, lease, "EXPIRED")]  # the claim at 0 + extension
    # The 30 s heartbeat no longer matches the holder's view (resync asked); the full
    # list in the next heartbeat is answered "lost": the reader knows one tick later.
    assert net.failures("D0") == [(35.0, "r1", "LEASE_LOST")]
    assert net.reader("D0").state("r1") == {0: ReadState.FAILED}


@pytest.mark.parametrize("seed", range(12))
def test_random_drop_dup_reorder_never_overlaps_silently(seed: int) -> None:
    net = Net(seed=seed)
    net.add_holder("P0")
    net.add_reader("D0")
    net.links.default = LinkFaults(
        drop=0.2, duplicate=0.2, reorder=0.2, reorder_window=3.0, jitter=3.0, delay=0.1
    )
    leases = {}
    for i in range(6):
        net.run_until(i * 2.0)
        leases[f"r{i}"] = granted(net, f"r{i}")
    deferred: list[str] = []

    def read_if_unread(rid: str, duration: float) -> None:
        r = net.reader("D0")
        state = r.state(rid)
        unread = all(
            s in (ReadState.TRACKED, ReadState.CLAIMED, ReadState.DEFERRED) for s in state.values()
        )
        ready = unread and r.ready_to_read(rid)
        if ready and isinstance(net.start_read("D0", rid, duration=duration), ReadDeferred):
            deferred.append(rid)  # asked again at later steps, as a binding does

    for i in range(6):
        net.run_until(20.0 + i * 7.0)
        for rid in list(dict.fromkeys(deferred)):
            read_if_unread(rid, 0.0)
        read_if_unread(f"r{i}", float(i % 3))
    for t in range(60, 80):
        net.run_until(float(t))
        for rid in list(dict.fromkeys(deferred)):
            read_if_unread(rid, 0.0)
    net.run_until(400.0)
    net.check_no_silent_overlap()
    freed = [lease for _, lease, _ in net.freed_leases()]
    assert len(freed) == len(set(freed)), "a lease was freed twice"
    assert set(freed) == set(leases.values()), "every lease ends eventually"
    assert net.holder("P0").live_leases() == 0


def test_abort_before_read_frees_at_once() -> None:
    net = one_pair()
    lease = granted(net)
    net.run_until(10.0)
    net.run_until(12.5)
    net.finish("D0", "r1")
    net.run_until(12.5)
    assert net.freed_leases() == [(12.5, lease, "ABORTED")]
    assert net.holder("P0").stats.aborted == 1


def test_abort_before_the_session_opens_frees_when_it_opens() -> None:
    """vLLM #41269: a request rejected before admission must not strand its blocks."""
    net = one_pair(latency=0.5)
    lease = granted(net)
    net.run_until(0.2)  # Hello in flight, no Welcome yet
    assert net.reader("D0").session_state("P", 0) is SessionState.HELLO_SENT
    net.finish("D0", "r1")
    net.run_until(100.0)
    # Welcome arrives at 1.0, the abort in the first heartbeat at 1.5.
    assert net.freed_leases() == [(1.5, lease, "ABORTED")]


def test_peer_lost_on_holder_frees_only_that_readers_leases() -> None:
    net = Net()
    net.add_holder("P0")
    net.add_reader("D0")
    net.add_reader("E0", engine="E")
    a = granted(net, "a", reader="D0")
    b = granted(net, "b", reader="E0")
    net.run_until(12.0)
    net.holder("P0").peer_lost(12.0, "D0")
    net.collect()
    assert net.freed_leases() == [(12.0, a, "PEER_LOST")]
    h = net.holder("P0")
    assert h.lease_state(a) is LeaseState.REVOKED
    assert h.lease_state(b) is LeaseState.HELD
    net.run_until(100.0)
    assert h.lease_state(b) is LeaseState.HELD


def test_transport_peer_lost_on_reader_fails_its_requests() -> None:
    net = one_pair()
    granted(net)
    net.run_until(5.0)
    net.reader("D0").peer_lost(5.0, "P0")
    net.collect()
    assert net.failures("D0") == [(5.0, "r1", "LEASE_LOST")]


def test_revoke_fails_the_reader_with_revoked() -> None:
    net = one_pair(latency=0.1)
    lease = granted(net)
    net.run_until(9.0)
    net.holder("P0").revoke(net.local("P0"), lease)
    net.collect()
    net.run_until(10.0)
    assert net.freed_leases() == [(9.0, lease, "REVOKED")]
    assert net.failures("D0") == [(pytest.approx(9.1), "r1", "REVOKED")]
    with pytest.raises(LocalProtocolError, match=r"revoked|cannot take"):
        net.holder("P0").revoke(10.0, lease)


def test_revoke_during_read_fences_the_read() -> None:
    net = one_pair()
    lease = granted(net)
    net.run_until(7.0)
    net.start_read("D0", "r1", duration=3.0)
    net.run_until(8.0)
    net.holder("P0").revoke(8.0, lease)
    net.run_until(30.0)
    assert net.freed_leases() == [(8.0, lease, "REVOKED")]
    assert net.failures("D0") == [(8.0, "r1", "REVOKED")]
    assert net.confirmed == []


def test_max_hold_caps_a_lease_that_is_heartbeated_forever() -> None:
    config = LeaseConfig(decoder_kv_blocks_ttl=60.0, max_hold=60.0)
    net = one_pair(config)
    lease = granted(net)
    net.run_until(59.9)
    assert net.freed == []
    net.run_until(100.0)
    assert net.freed_leases() == [(60.0, lease, "MAX_HOLD")]
    assert net.failures("D0") == [(60.0, "r1", "REVOKED")]
    assert net.holder("P0").stats.max_hold == 1


def test_ticket_of_a_restarted_holder_fails_holder_restarted() -> None:
    net = one_pair()
    ticket = net.grant("P0", "p-r1")
    restart_holder(net)  # P restarted before D connected
    net.track("D0", "r1", ticket)
    # The new process knows no old token: it cannot sign an answer to a Hello anchored
    # on one (and an unsigned "restarted" would let anyone fail D's requests). D's
    # Hellos go unanswered until the ticket's lease is surely over (its 20 s unclaimed,
    # drift included): the next retry, at 25, fails the request. Never read.
    net.run_until(24.9)
    assert net.failures("D0") == []
    net.run_until(26.0)
    assert net.failures("D0") == [(25.0, "r1", "LEASE_LOST")]
    assert net.confirmed == []


def test_holder_restart_under_an_open_session_fails_holder_restarted() -> None:
    net = one_pair()
    granted(net)
    net.run_until(7.0)
    restart_holder(net)
    net.run_until(39.9)
    # The 10 s heartbeat gets Reject(NO_SESSION); D says Hello again, anchored on its
    # only (old) ticket, which the new process cannot prove anything about: no Welcome.
    # The lease is surely over one extension after the unanswered 10 s heartbeat could
    # have arrived (10 + ack_timeout 5 + 20, drift included): the retry at 40 fails it.
    assert net.failures("D0") == []
    assert net.reader("D0").session_state("P", 0) is SessionState.HELLO_SENT
    net.run_until(41.0)
    assert net.failures("D0") == [(40.0, "r1", "LEASE_LOST")]
    assert net.confirmed == []


def restart_holder(net: Net, *, clock_offset: float = 0.0) -> None:
    """P0's process dies and comes back as incarnation 8 under the same transport name."""
    net.nodes["P0"].core = Holder(net.config, engine="P", incarnation=8)
    net.nodes["P0"].offset = clock_offset
    net.nodes["P0"].last_local = -float("inf")


@pytest.mark.parametrize("peer_lost_reported", [False, True])
def test_tickets_of_the_restarted_holder_work(peer_lost_reported: bool) -> None:
    """After a holder restart every new ticket names the new incarnation; the reader must
    learn it (it failed them all HOLDER_RESTARTED, forever: the session kept the old one)."""
    net = one_pair()
    granted(net, "old")
    net.run_until(7.0)
    restart_holder(net, clock_offset=-1000.0)  # a new process, a new clock epoch
    if peer_lost_reported:
        net.reader("D0").peer_lost(net.local("D0"), "P0")
        net.collect()
    net.run_until(8.0)
    fresh = granted(net, "new")
    net.run_until(9.0)
    assert net.failures("D0")[0][1:] in (("old", "HOLDER_RESTARTED"), ("old", "LEASE_LOST"))
    assert "new" not in {rid for _, rid, _ in net.failures("D0")}
    assert net.holder("P0").lease_state(fresh) is LeaseState.HELD
    # The old process's clock sample is gone: the new ticket's bound is sane.
    bound = net.reader("D0").deadline_bound(net.local("D0"), "new")
    assert 8.0 < bound <= net.holder("P0").deadline(fresh) + 1000.0
    go = net.start_read("D0", "new")
    assert isinstance(go, ReadGo)
    net.run_until(10.0)
    assert [rid for _, _, rid in net.confirmed] == ["new"]
    # A ticket of the dead incarnation, now known dead, fails at once.
    old_holder = Holder(net.config, engine="P", incarnation=7)
    net.track("D0", "late-old", old_holder.grant(0.0, request_id="x"))
    assert net.failures("D0")[-1] == (10.0, "late-old", "HOLDER_RESTARTED")


def test_stale_ticket_converted_with_clock_sample_is_refused() -> None:
    net = one_pair()
    granted(net, "a")  # opens the session; gives the reader a clock sample
    net.run_until(50.0)
    late = net.grant("P0", "p-b")
    net.run_until(100.0)  # the ticket waited 50 s at the client: its 30 s lease lapsed
    net.track("D0", "b", late)
    assert net.failures("D0")[-1] == (100.0, "b", "BAD_TICKET")


def test_reader_bound_and_decline_respect_max_hold() -> None:
    """Heartbeats renew the session, never past grant + max_hold: the reader's bound
    must not promise more (it did: 69.99 against a true 60), and it declines in time."""
    config = LeaseConfig(decoder_kv_blocks_ttl=60.0, max_hold=60.0)
    net = one_pair(config)
    lease = granted(net)
    for t in (20.0, 45.0, 51.0, 54.0):
        net.run_until(t)
        bound = net.reader("D0").deadline_bound(net.local("D0"), "r1")
        assert bound <= net.holder("P0").deadline(lease) == min(60.0, t // 5 * 5 + 20.0)
    assert 59.98 <= bound <= 60.0  # minus drift allowances over seconds, not the 20 s extension
    net.run_until(55.5)
    assert isinstance(net.start_read("D0", "r1"), ReadDeclined)  # 55.5 + 5 > 59.99


def test_bound_of_a_read_lease_stops_following_later_heartbeats() -> None:
    """Once rank 0's read completed its session no longer carries the lease (the holder
    detached it at the done): heartbeats in sync after that prove nothing about it. The
    bound used to say 34.99 s for a lease that only rank 1's silent session kept to 30 s."""
    net = Net()
    net.add_holder("P0")
    net.add_reader("D0", rank=0, tp_size=2)
    net.add_reader("D1", rank=1, tp_size=2)
    ticket = net.grant("P0", "p-r")
    net.track("D0", "r", ticket)
    net.track("D1", "r", ticket)
    net.run_until(3.0)
    net.crash("D1")  # its session lives until 0 + 20
    net.run_until(14.9)
    net.frame_filter = lambda s, d, p: not isinstance(wire.decode(p), wire.DoneAck)
    net.start_read("D0", "r")  # the done arrives, its HELD verdict is lost
    h, r = net.holder("P0"), net.reader("D0")
    for t in (14.9, 15.0, 17.0, 19.0):
        net.run_until(t)
        assert h.lease_state(ticket.lease) is LeaseState.HELD
        assert r.state("r") == {0: ReadState.AWAITING_ACK}
        assert r.deadline_bound(net.local("D0"), "r") <= h.deadline(ticket.lease) == 30.0
