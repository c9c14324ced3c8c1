"""A read whose deadline bound is close only because no heartbeat left lately is
deferred for one early heartbeat instead of declined (exact-time pair tests).

Setup shared by the tests: granted and tracked at 0, heartbeats every 5 s up to 20
(each acknowledged at once), so the reader's bound is 20 + 20 * (1 - 500 ppm) = 39.99
while the holder's deadline is 40. Then the reader stalls (a long forward step).
"""

from __future__ import annotations

import pytest

from kvproto.config import LeaseConfig
from kvproto.errors import LocalProtocolError
from kvproto.events import FailReason, ReadDeclined, ReadDeferred, ReadGo, RequestFailed
from kvproto.states import ReadInput, ReadState, read_next
from tests.core.pair import HOLDER, READER, Pair


def stalled_pair(config: LeaseConfig | None = None) -> Pair:
    pair = Pair(config=config or LeaseConfig())
    pair.grant_and_track(0.0)
    pair.run_until(20.0, step=5.0)
    assert pair.reader.deadline_bound(20.0, "r1") == pytest.approx(39.99)
    assert pair.holder.deadline(1) == pytest.approx(40.0)
    return pair


def test_stalled_reader_defers_heartbeats_and_then_reads_held() -> None:
    pair = stalled_pair()
    sent = pair.reader.stats.heartbeats_sent
    # 36 + 5 >= 39.99: today's rule would decline; the lease is merely unrenewed.
    result = pair.reader.begin_read(36.0, "r1")
    assert result == ReadDeferred(until=41.0, heartbeats=1)
    assert pair.reader.state("r1") == {0: ReadState.DEFERRED}
    assert pair.reader.stats.heartbeats_sent == sent + 1
    # Asked again before the answer: same deferral, no second heartbeat.
    assert pair.reader.begin_read(36.0, "r1") == ReadDeferred(until=41.0, heartbeats=0)
    # The early heartbeat is the session's normal one: the next tick counts from it.
    assert pair.reader.get_timer() == 41.0
    pair.deliver(36.02)
    assert pair.holder.deadline(1) == pytest.approx(56.02)
    assert pair.reader.deadline_bound(36.02, "r1") == pytest.approx(36.0 + 20 * (1 - 5e-4))
    assert pair.reader.get_timer() == 41.0  # the deferral is settled: no decline timer
    pair.read(36.02)
    assert pair.confirmed == ["r1"]
    assert pair.holder.stats_snapshot()["released_done"] == 1
    assert [f.reason.name for f in pair.freed] == ["DONE"]
    assert pair.reader.stats.deferred == 1 and pair.reader.stats.declined == 0
    assert pair.failed == []


def test_no_answer_to_the_early_heartbeat_declines_at_the_bounded_time() -> None:
    pair = stalled_pair()
    assert isinstance(pair.reader.begin_read(36.0, "r1"), ReadDeferred)
    pair.collect(36.0)
    pair.to_holder.clear()  # the heartbeat is lost; the holder stays silent
    assert pair.reader.get_timer() == 41.0
    pair.reader.handle_timer(40.99)
    pair.collect(40.99)
    assert pair.failed == []
    pair.reader.handle_timer(41.0)  # 36 + ack_timeout
    pair.collect(41.0)
    assert pair.failed == [RequestFailed(request_id="r1", reason=FailReason.DEADLINE_TOO_CLOSE)]
    assert pair.reader.state("r1") == {0: ReadState.FAILED}
    assert pair.reader.stats.declined == 1
    # A begin_read racing the failure is declined with its reason, not misuse.
    assert pair.reader.begin_read(41.0, "r1") == ReadDeclined(reason=FailReason.DEADLINE_TOO_CLOSE)
    assert pair.reader.stats.reads_after_failure == 1
    assert pair.reader.state("r1") == {0: ReadState.FAILED}
    assert pair.reader.stats.declined == 1


def test_a_retry_after_the_bounded_wait_declines_without_the_timer() -> None:
    pair = stalled_pair()
    assert isinstance(pair.reader.begin_read(36.0, "r1"), ReadDeferred)
    pair.collect(36.0)
    pair.to_holder.clear()
    assert pair.reader.begin_read(41.0, "r1") == ReadDeclined(reason=FailReason.DEADLINE_TOO_CLOSE)


@pytest.mark.parametrize("overdue_beat_first", [False, True])
def test_a_lapsed_lease_still_declines_at_once(overdue_beat_first: bool) -> None:
    pair = stalled_pair()
    pair.holder.handle_timer(40.0)
    pair.collect(40.0)
    assert [f.reason.name for f in pair.freed] == ["EXPIRED"]
    if overdue_beat_first:
        # The binding runs the reader's timer before the read: the overdue heartbeat
        # leaves at 45, after the lease ended, so it cannot have renewed it.
        pair.reader.handle_timer(45.0)
    assert pair.reader.begin_read(45.0, "r1") == ReadDeclined(reason=FailReason.DEADLINE_TOO_CLOSE)
    assert pair.reader.stats.deferred == 0


def test_max_hold_within_the_margin_declines_at_once() -> None:
    pair = stalled_pair(LeaseConfig(max_hold=40.0, decoder_kv_blocks_ttl=30.0))
    # Renewing cannot help: the holder's hard cap ends the lease at 40 whatever we send.
    assert pair.reader.begin_read(36.0, "r1") == ReadDeclined(reason=FailReason.DEADLINE_TOO_CLOSE)
    assert pair.reader.stats.deferred == 0


def test_one_deferral_per_request() -> None:
    # Margin 10 s and a 12 s wait, so that an answer can come back in time yet leave
    # the bound too close: the read is then declined, never deferred a second time.
    pair = stalled_pair(LeaseConfig(read_margin=10.0, ack_timeout=12.0))
    assert pair.reader.begin_read(30.0, "r1") == ReadDeferred(until=42.0, heartbeats=1)
    pair.collect(30.0)
    for frame in list(pair.to_holder):
        pair.holder.handle_frame(30.0, READER, frame)
    pair.to_holder.clear()
    pair.collect(30.0)
    acks = list(pair.to_reader)
    pair.to_reader.clear()
    for frame in acks:  # the answer is slow: bound 30 + 19.99 < 41 + 10
        pair.reader.handle_frame(41.0, HOLDER, frame)
    assert pair.reader.begin_read(41.0, "r1") == ReadDeclined(reason=FailReason.DEADLINE_TOO_CLOSE)
    assert pair.reader.stats.deferred == 1 and pair.reader.stats.declined == 1
    with pytest.raises(LocalProtocolError):
        read_next(ReadState.DEFERRED, ReadInput.DEFER)


def test_finishing_a_deferred_request_aborts_its_lease() -> None:
    pair = stalled_pair()
    assert isinstance(pair.reader.begin_read(36.0, "r1"), ReadDeferred)
    pair.deliver(36.0)
    pair.reader.finish(36.5, "r1")
    pair.deliver(36.5)
    assert [f.reason.name for f in pair.freed] == ["ABORTED"]
    # No decline timer is left: only the session's tick, restarted by the abort's heartbeat.
    assert pair.reader.get_timer() == 41.5


def test_a_fresh_read_is_not_deferred() -> None:
    pair = stalled_pair()
    assert isinstance(pair.reader.begin_read(30.0, "r1"), ReadGo)
    assert pair.reader.stats.deferred == 0
