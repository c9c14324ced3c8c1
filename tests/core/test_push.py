"""Push mode, exact times: D holds a writable lease on its empty blocks, P writes them.

Roles reversed (spec/push-mode.md): the holder core runs on D, the reader core on P
with ``writes=True``. What is checked at the float: the write fence (a lease that ends
while an armed P may still write is quarantined: ``WriteFenced`` then ``FreeBlocks``
at the last disarm, never before the write's data could have landed), the writer's
rules (claims renew, an acknowledged Arm comes right before the write, the deadline
bound past the margin; an abort is held back while the write is in flight), and the
frees after P's loss.

Default config: 30 s lease, 5 s interval, 20 s extension, 5 s read margin.
"""

from __future__ import annotations

import pytest

from kvproto import wire
from kvproto.config import LeaseConfig
from kvproto.errors import LocalProtocolError
from kvproto.events import FailReason, ReadDeclined, ReadDeferred, ReadGo
from kvproto.states import LeaseState, ReadState, WriteState
from kvproto.tpmath import BlockSlice

from .net import LinkFaults
from .pushnet import PushNet

WINDOW = LeaseConfig().grant_ttl
"""How long a grant lives unclaimed (the claim window: the extension, 20 s at a 30 s lease)."""


def pair(**link: float) -> PushNet:
    """D0 (holder, engine D) and P0 (writer, engine P); ``link`` faults both ways."""
    net = PushNet()
    net.add_holder("D0", engine="D")
    net.add_reader("P0", engine="P")
    if link:
        net.links.default = LinkFaults(**link)
    return net


def claimed(net: PushNet, request_id: str = "r1") -> int:
    """D grants at 0, P tracks to write at 0; the claim is acknowledged by the return (a
    claim renews the lease, it does not arm the write fence)."""
    ticket = net.grant_writable("D0", "d-" + request_id)
    net.track_writer("P0", request_id, ticket)
    net.run_until(net.now)
    assert net.reader("P0").write_ready(request_id)
    assert net.holder("D0").write_state(ticket.lease) is WriteState.OPEN
    return ticket.lease


def aborts_sent(net: PushNet, since: float) -> list[tuple[float, list[int]]]:
    """(time, leases) of every heartbeat P sent from ``since`` on that carried an abort."""
    out = []
    for t, src, _dst, payload in net.sent:
        if src != "P0" or t < since:
            continue
        msg = wire.decode(payload)
        if isinstance(msg, wire.Heartbeat) and msg.aborts:
            out.append((t, [c.lease for c in msg.aborts]))
    return out


def test_write_on_an_acknowledged_claim_fills_the_blocks_at_the_done() -> None:
    net = pair()
    lease = claimed(net)
    net.run_until(1.0)
    go = net.start_write("P0", "r1", duration=0.5)
    assert isinstance(go, ReadGo) and go.orders[0].notify
    net.run_until(3.0)
    # The done rode the write: D settles at its arrival with DONE (the blocks are filled
    # and used), P is confirmed HELD. Nothing was fenced.
    assert net.freed_leases() == [(1.5, lease, "DONE")]
    assert net.fenced_leases() == []
    assert net.confirmed == [(1.5, "P0", "r1")]
    assert net.holder("D0").write_state(lease) is WriteState.SETTLED
    assert net.reader("P0").stats.writes_started == 1
    net.check_write_fence()


def test_the_write_waits_for_the_arms_round_trip() -> None:
    net = pair(delay=0.1)
    lease = claimed_at_latency(net)
    writer = net.reader("P0")
    deferred = writer.begin_write(net.local("P0"), "r1")
    assert deferred == ReadDeferred(until=1.0 + 5.0, heartbeats=0)
    assert writer.state("r1") == {0: ReadState.ARMING}
    net.collect()
    net.run_until(1.05)
    assert net.holder("D0").write_state(lease) is WriteState.OPEN  # the Arm lands at 1.1
    net.run_until(1.1)
    assert net.holder("D0").write_state(lease) is WriteState.ARMED
    net.run_until(1.15)
    assert writer.begin_write(1.15, "r1") == deferred  # the ArmAck lands at 1.2
    net.run_until(1.25)
    assert writer.state("r1") == {0: ReadState.ARMED}
    # The ArmAck's bound: sent 1.0, the lease had 20.3 - 1.1 left at D (the grant's claim
    # window, renewed by the claim at 0.3 to 0.3 + e): 1.0 + 19.2 less drift.
    assert writer.deadline_bound(1.25, "r1") == pytest.approx(1.0 + 19.2 * (1 - 500e-6))
    go = writer.begin_write(1.25, "r1")
    assert isinstance(go, ReadGo) and writer.state("r1") == {0: ReadState.READING}


def claimed_at_latency(net: PushNet) -> int:
    """As :func:`claimed` over links of 0.1 s: Hello 0 → Welcome 0.2, claim 0.3 → ack 0.4."""
    ticket = net.grant_writable("D0", "d-r1")
    net.track_writer("P0", "r1", ticket)
    net.run_until(1.0)
    assert net.reader("P0").write_ready("r1")
    return ticket.lease


def test_an_unanswered_arm_is_resent_then_declined() -> None:
    net = pair(delay=0.1)
    lease = claimed_at_latency(net)
    arms: list[float] = []

    def lose_arms(src: str, dst: str, payload: bytes) -> bool:
        if isinstance(wire.decode(payload), wire.Arm):
            arms.append(net.now)
            return False
        return True

    net.frame_filter = lose_arms
    writer = net.reader("P0")
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        net.run_until(t)
        assert isinstance(writer.begin_write(t, "r1"), ReadDeferred)
        net.collect()
    net.run_until(6.0)
    # Re-sent once a third of ack_timeout passed without an answer; declined at 1 + 5.
    assert writer.begin_write(6.0, "r1") == ReadDeclined(reason=FailReason.NOT_ARMED)
    assert arms == [1.0, 3.0, 5.0]
    net.run_until(10.0)
    # Never armed: P's abort (not a write in flight) frees D's blocks at its arrival.
    assert net.freed_leases() == [(6.1, lease, "ABORTED")]
    assert net.fenced_leases() == []


def test_an_arm_of_an_ended_lease_is_refused_and_fails_the_write() -> None:
    net = pair()
    lease = claimed(net)
    net.run_until(1.0)
    net.holder("D0").revoke(net.local("D0"), lease)
    net.frame_filter = lambda src, dst, payload: not isinstance(wire.decode(payload), wire.Revoke)
    net.collect()
    declined = net.start_write("P0", "r1", duration=0.5)
    # The ArmAck says "not armed": the request fails LEASE_LOST, and the write never starts.
    assert declined == ReadDeclined(reason=FailReason.LEASE_LOST)
    assert net.writes == []
    assert net.freed_leases() == [(1.0, lease, "REVOKED")]
    assert net.fenced_leases() == []


def test_no_write_before_the_claim_is_acknowledged() -> None:
    net = pair(delay=0.1)
    ticket = net.grant_writable("D0", "d-r1")
    net.track_writer("P0", "r1", ticket)
    net.run_until(0.1)  # the Hello reached D; the Welcome is on its way back
    writer = net.reader("P0")
    assert not writer.write_ready("r1")
    with pytest.raises(LocalProtocolError, match="claim is not acknowledged"):
        writer.begin_write(net.local("P0"), "r1")
    net.run_until(1.0)
    # Hello at 0, Welcome back at 0.2, the claim's heartbeat at D at 0.3, its ack at 0.4.
    assert net.arrivals("D0", "P0", wire.HeartbeatAck) == [0.4]
    assert writer.write_ready("r1")
    assert writer.state("r1") == {0: ReadState.CLAIMED}


def test_begin_write_is_refused_for_a_request_tracked_to_read() -> None:
    net = pair()
    ticket = net.grant("D0", "d-r1")
    net.track("P0", "r1", ticket)
    net.run_until(0.0)
    with pytest.raises(LocalProtocolError, match="not tracked to write"):
        net.reader("P0").begin_write(0.0, "r1")


def test_write_declined_when_the_bound_is_within_the_margin() -> None:
    net = pair()
    lease = claimed(net)
    # P's heartbeats stop reaching D: the ack of the claim (sent at 0, 20 s left: the claim
    # window, renewed to 0 + e) is the last word, so the bound is 20 s less drift; at 15.0
    # it is within the 5 s margin.
    net.frame_filter = lambda src, dst, payload: not (src == "P0" and net.now > 0.0)
    net.run_until(15.0)
    declined = net.start_write("P0", "r1", duration=0.5)
    assert declined == ReadDeclined(reason=FailReason.DEADLINE_TOO_CLOSE)
    assert net.failures("P0") == [(15.0, "r1", "DEADLINE_TOO_CLOSE")]
    assert net.writes == []
    net.run_until(40.0)
    # Nothing was armed (the bound was checked before any Arm) and P's abort was lost
    # with its other frames: D expires the lease at its own deadline and frees it then.
    assert net.freed_leases() == [(20.0, lease, "EXPIRED")]
    assert net.fenced_leases() == []


def test_slow_write_past_the_deadline_is_quarantined_until_its_done_lands() -> None:
    net = pair()
    lease = claimed(net)
    net.run_until(1.0)
    go = net.start_write("P0", "r1", duration=40.0)  # lands at 41
    assert isinstance(go, ReadGo)
    # P's heartbeats stop reaching D from here on (the write's done is not a heartbeat).
    net.frame_filter = lambda src, dst, payload: src != "P0"
    net.run_until(60.0)
    # The lease lives until max(own 20, session 0 + 20) = 20, then ends with the writer
    # armed: fenced at 20, not freed; the late done lands at 41 (answered LATE) and
    # disarms P: freed at 41 with the reason it ended for.
    assert net.fenced_leases() == [(20.0, lease, "EXPIRED")]
    assert net.freed_leases() == [(41.0, lease, "EXPIRED")]
    assert net.holder("D0").lease_state(lease) is LeaseState.EXPIRED
    assert net.holder("D0").stats.write_fenced == 1
    assert net.holder("D0").stats.late_done == 1
    net.check_write_fence()


def test_revoke_mid_write_holds_the_abort_back_until_the_write_lands() -> None:
    net = pair()
    lease = claimed(net)
    net.run_until(1.0)
    net.start_write("P0", "r1", duration=10.0)  # lands at 11
    net.run_until(5.0)
    net.holder("D0").revoke(net.local("D0"), lease)
    net.run_until(20.0)
    # Revoked at 5 with P armed: fenced. P fails the request on the Revoke, but its
    # write is in flight: the abort is held back, and never sent (the write landed and
    # its done disarmed P at 11, which frees the blocks).
    assert net.fenced_leases() == [(5.0, lease, "REVOKED")]
    assert net.failures("P0") == [(5.0, "r1", "REVOKED")]
    assert net.reader("P0").stats.aborts_held == 1
    assert aborts_sent(net, since=0.0) == []
    assert net.freed_leases() == [(11.0, lease, "REVOKED")]
    net.check_write_fence()


def test_a_failed_write_sends_its_held_abort_which_frees() -> None:
    net = pair()
    lease = claimed(net)
    net.run_until(1.0)
    net.start_write("P0", "r1", duration=10.0, fail=True)  # reported failed at 11
    net.run_until(5.0)
    net.holder("D0").revoke(net.local("D0"), lease)
    net.run_until(20.0)
    assert net.fenced_leases() == [(5.0, lease, "REVOKED")]
    assert aborts_sent(net, since=0.0) == [(11.0, [lease])]
    assert net.freed_leases() == [(11.0, lease, "REVOKED")]
    net.check_write_fence()


def test_a_write_that_fails_on_its_own_aborts_at_the_failure() -> None:
    net = pair()
    lease = claimed(net)
    net.run_until(1.0)
    net.start_write("P0", "r1", duration=2.0, fail=True)
    net.run_until(10.0)
    # No abort while the write was in flight; at its failure P fails the request and
    # aborts: D ends the lease ABORTED with P disarmed, freed at once, never fenced.
    assert net.failures("P0") == [(3.0, "r1", "READ_FAILED")]
    assert aborts_sent(net, since=0.0) == [(3.0, [lease])]
    assert net.freed_leases() == [(3.0, lease, "ABORTED")]
    assert net.fenced_leases() == []


def test_finish_before_writing_aborts_and_frees_at_once() -> None:
    net = pair()
    lease = claimed(net)
    net.run_until(2.0)
    net.finish("P0", "r1")
    net.run_until(3.0)
    assert net.freed_leases() == [(2.0, lease, "ABORTED")]
    assert net.fenced_leases() == []


def test_finish_mid_write_holds_the_abort_and_the_late_completion_is_counted() -> None:
    net = pair()
    lease = claimed(net)
    net.run_until(1.0)
    net.start_write("P0", "r1", duration=3.0)  # lands at 4
    net.run_until(2.0)
    net.finish("P0", "r1")
    net.run_until(10.0)
    # The abort waited for the write; the done it rode made D settle DONE at 4 (the
    # blocks are filled: D decides on its own, P's request is gone).
    assert aborts_sent(net, since=0.0) == []
    assert net.freed_leases() == [(4.0, lease, "DONE")]
    assert net.reader("P0").stats.late_read_results == 1
    net.check_write_fence()


def test_reported_loss_of_the_writer_frees_at_once_even_mid_write() -> None:
    net = pair()
    lease = claimed(net)
    net.run_until(1.0)
    net.start_write("P0", "r1", duration=100.0)
    net.run_until(2.0)
    net.crash("P0", detect_after=1.0)  # D hears PEER_LOST at 3
    net.run_until(200.0)
    # The loss is the transport's proof that P writes no more: disarmed first, then the
    # lease ends PEER_LOST with nobody armed, freed at the report.
    assert net.freed_leases() == [(3.0, lease, "PEER_LOST")]
    assert net.fenced_leases() == []


def test_silent_crash_before_claiming_frees_at_the_deadline() -> None:
    net = pair()
    ticket = net.grant_writable("D0", "d-r1")
    net.crash("P0")
    net.track_writer("P0", "r1", ticket)  # nothing it sends leaves
    net.run_until(100.0)
    assert net.freed_leases() == [(WINDOW, ticket.lease, "EXPIRED")]
    assert net.fenced_leases() == []


def test_silent_crash_after_claiming_frees_at_the_deadline_when_not_armed() -> None:
    # P claimed at 0 (its prefill or its queue before the write), renewed until its crash
    # at 12, and never armed: nothing of it can be in flight, so expiry frees.
    net = pair()
    lease = claimed(net)
    net.run_until(12.0)
    net.crash("P0")
    net.run_until(100.0)
    # Last heartbeat arrived at 10: 10 + 20 = 30 = own deadline.
    assert net.freed_leases() == [(30.0, lease, "EXPIRED")]
    assert net.fenced_leases() == []


def test_silent_crash_after_arming_quarantines_until_the_loss_is_reported() -> None:
    net = pair()
    lease = claimed(net)
    net.run_until(1.0)
    writer = net.reader("P0")
    assert isinstance(writer.begin_write(1.0, "r1"), ReadDeferred)
    net.collect()
    net.run_until(1.0)
    assert net.holder("D0").write_state(lease) is WriteState.ARMED
    net.crash("P0")  # armed, and dead before its write
    net.run_until(1000.0)
    # Armed and silent: ended at the deadline but not freed, however long; no timer can
    # tell a dead writer from a paused one.
    assert net.fenced_leases() == [(20.0, lease, "EXPIRED")]  # claimed at 0: 0 + e
    assert net.freed_leases() == []
    assert net.holder("D0").stats_snapshot()["leases_quarantined"] == 1
    net.holder("D0").peer_lost(net.local("D0"), "P0")
    net.collect()
    assert net.freed_leases() == [(1000.0, lease, "EXPIRED")]
    assert net.holder("D0").stats_snapshot()["leases_quarantined"] == 0


def test_a_quarantined_lease_is_not_forgotten_and_its_tombstone_starts_at_the_free() -> None:
    config = LeaseConfig(tombstone_ttl=10.0)
    net = PushNet(config)
    net.add_holder("D0", engine="D")
    net.add_reader("P0", engine="P")
    lease = claimed(net)
    net.run_until(1.0)
    net.start_write("P0", "r1", duration=200.0)  # lands at 201
    net.frame_filter = lambda src, dst, payload: src != "P0"
    net.run_until(300.0)
    holder = net.holder("D0")
    # Ended at 20; its done at 201 still finds it (answered LATE, not unknown).
    assert net.freed_leases() == [(201.0, lease, "EXPIRED")]
    assert holder.stats.late_done == 1 and holder.stats.unknown_lease == 0
    assert holder.lease_state(lease) is None  # forgotten at 201 + 10


def test_two_writer_ranks_one_slow_keeps_the_quarantine_until_its_done() -> None:
    net = PushNet()
    net.add_holder("D0", engine="D")
    net.add_reader("P0", engine="P", rank=0, tp_size=2)
    net.add_reader("P1", engine="P", rank=1, tp_size=2)
    ticket = net.grant_writable("D0", "d-r1")
    net.track_writer("P0", "r1", ticket)
    net.track_writer("P1", "r1", ticket)
    net.run_until(1.0)
    net.start_write("P0", "r1", duration=0.5)  # lands at 1.5
    net.start_write("P1", "r1", duration=40.0)  # lands at 41
    net.frame_filter = lambda src, dst, payload: src not in ("P0", "P1")
    net.run_until(60.0)
    # Rank 0's done at 1.5 counts (1 of 2) and disarms rank 0; the lease ends at 20
    # with rank 1 armed, and is freed at rank 1's late done.
    assert net.fenced_leases() == [(20.0, ticket.lease, "EXPIRED")]
    assert net.freed_leases() == [(41.0, ticket.lease, "EXPIRED")]
    net.check_write_fence()


def test_a_new_incarnation_under_the_writers_name_does_not_disarm_it() -> None:
    # Class D of the threat model: any engine with a ticket of its own can say Hello as a
    # new incarnation under P's transport name. That ends the old session's leases, but
    # it is no proof that P writes no more: only the transport's loss report is.
    from .rawsession import open_session

    net = pair()
    lease = claimed(net)
    net.run_until(1.0)
    net.start_write("P0", "r1", duration=50.0)
    net.run_until(2.0)
    holder = net.holder("D0")
    decoy = net.grant_writable("D0", "d-decoy")
    # (open_session drains what the holder said: its WriteFenced among it.)
    assert open_session(holder, decoy, "P0", now=2.0, engine="P", incarnation=12345)
    assert holder.lease_state(lease) is LeaseState.REVOKED  # ended PEER_LOST
    assert holder.write_state(lease) is WriteState.QUARANTINED
    assert holder.stats.write_fenced == 1
    net.run_until(60.0)
    # The real write lands at 51: P's done finds no session of P under that name now
    # (the impostor's), so it does not disarm; the transport's word on the peer does.
    # (The decoy, never claimed, expired on its own at 2 + the claim window.)
    assert net.freed_leases() == [(2.0 + WINDOW, decoy.lease, "EXPIRED")]
    holder.peer_lost(net.local("D0"), "P0")
    net.collect()
    assert net.freed_leases()[1:] == [(60.0, lease, "PEER_LOST")]
    net.check_write_fence()


def test_replicated_kv_writer_tp1_writes_the_whole_latent_into_each_holder_rank() -> None:
    """MLA, P TP 1 -> D TP 2: every D rank keeps the whole latent, so P's one rank writes
    whole blocks into both (a read would take them from one); each D rank frees on its done."""
    net = PushNet()
    for rank in range(2):
        net.add_holder(f"D{rank}", engine="D", rank=rank, tp_size=2)
    net.add_reader("P0", engine="P", replicated_kv=True)
    ticket = net.grant_writable("D0", "d-r1")
    net.holder("D1").adopt(net.local("D1"), ticket, writable=True)
    net.track_writer("P0", "r1", ticket)
    net.run_until(1.0)
    go = net.start_write("P0", "r1", duration=0.5)
    assert isinstance(go, ReadGo)
    assert sorted(
        (o.holder_rank, o.carries_data, o.local_slice, o.remote_slice) for o in go.orders
    ) == [(0, True, BlockSlice.FULL, BlockSlice.FULL), (1, True, BlockSlice.FULL, BlockSlice.FULL)]
    net.run_until(5.0)
    assert [net.freed_leases(h) for h in ("D0", "D1")] == [[(1.5, ticket.lease, "DONE")]] * 2
    net.check_write_fence()


def test_replicated_kv_writer_tp2_writes_from_one_rank_the_other_sends_its_done() -> None:
    """MLA, P TP 2 -> D TP 1: both P ranks hold the same latent; the first writes it, the
    second's write carries no data, only the done D counts (two expected consumers)."""
    net = PushNet()
    net.add_holder("D0", engine="D")
    for rank in range(2):
        net.add_reader(f"P{rank}", engine="P", rank=rank, tp_size=2, replicated_kv=True)
    ticket = net.grant_writable("D0", "d-r1")
    for rank in range(2):
        net.track_writer(f"P{rank}", "r1", ticket)
    net.run_until(1.0)
    orders = []
    for rank in range(2):
        go = net.start_write(f"P{rank}", "r1", duration=0.5)
        assert isinstance(go, ReadGo)
        orders += [(rank, o.holder_rank, o.carries_data, o.remote_slice) for o in go.orders]
    assert orders == [(0, 0, True, BlockSlice.FULL), (1, 0, False, BlockSlice.FULL)]
    net.run_until(5.0)
    assert net.freed_leases("D0") == [(1.5, ticket.lease, "DONE")]
    net.check_write_fence()
