"""Races between the binding and the reader are inputs: counted and ignored, never raised.

A transfer result for a request the scheduler finished meanwhile, a second
``finish``, a connect that completes after its session broke: each is a
normal event on a busy engine. Real misuse (a rank the request does not read
from, a session never asked for, tracking one id twice) still raises.
"""

from __future__ import annotations

import pytest

from kvproto.config import LeaseConfig
from kvproto.errors import LocalProtocolError
from kvproto.events import Connect, FailReason, ReadGo, RequestFailed
from kvproto.states import SessionState
from tests.core.pair import HOLDER, Pair


def test_is_tracked_follows_track_and_finish() -> None:
    pair = Pair()
    assert not pair.reader.is_tracked("r1")
    pair.grant_and_track(0.0)
    assert pair.reader.is_tracked("r1")
    pair.reader.finish(1.0, "r1")
    assert not pair.reader.is_tracked("r1")


def test_read_result_after_finish_is_a_counted_no_op() -> None:
    pair = Pair()
    pair.grant_and_track(0.0)
    pair.run_until(2.0)
    go = pair.reader.begin_read(2.0, "r1")
    assert isinstance(go, ReadGo)
    pair.reader.finish(2.5, "r1")  # aborted while the read is in flight
    pair.collect(2.5)
    pair.reader.read_completed(3.0, "r1", 0)
    pair.reader.read_failed(3.0, "r1", 0)
    assert pair.reader.stats.late_read_results == 2
    assert pair.reader.drain() == []
    assert pair.confirmed == [] and pair.failed == []


def test_read_completed_after_the_request_failed_changes_nothing() -> None:
    pair = Pair()
    pair.grant_and_track(0.0)
    pair.run_until(2.0)
    go = pair.reader.begin_read(2.0, "r1")
    assert isinstance(go, ReadGo)
    pair.reader.peer_lost(2.5, HOLDER)  # fails the request, the transfer still runs
    pair.collect(2.5)
    assert pair.failed == [RequestFailed(request_id="r1", reason=FailReason.LEASE_LOST)]
    pair.reader.read_completed(3.0, "r1", 0)
    assert pair.reader.drain() == []
    assert pair.reader.get_timer() is None  # nothing awaited for a failed read


def test_a_rank_the_request_does_not_read_from_is_misuse() -> None:
    pair = Pair()
    pair.grant_and_track(0.0)
    with pytest.raises(LocalProtocolError):
        pair.reader.read_completed(1.0, "r1", 3)
    with pytest.raises(LocalProtocolError):
        pair.reader.read_failed(1.0, "r1", 3)


def test_finish_twice_or_of_an_unknown_id_is_a_counted_no_op() -> None:
    pair = Pair()
    pair.grant_and_track(0.0)
    pair.reader.finish(1.0, "r1")
    pair.collect(1.0)
    pair.reader.finish(1.5, "r1")
    pair.reader.finish(1.5, "never-tracked")
    assert pair.reader.stats.untracked_finishes == 2
    assert pair.reader.drain() == []


def test_connected_after_the_session_broke_stays_broken() -> None:
    pair = Pair(auto_connect=False)
    pair.grant_and_track(0.0)
    assert pair.connects == [Connect(engine="P", rank=0)]
    pair.reader.connect_failed(1.0, engine="P", rank=0)
    pair.collect(1.0)
    assert [f.reason for f in pair.failed] == [FailReason.CONNECT_FAILED]
    pair.reader.connected(1.5, engine="P", rank=0, peer=HOLDER)  # the late connect
    assert pair.reader.session_state("P", 0) is SessionState.BROKEN
    assert pair.reader.stats.stale_connects == 1
    assert pair.reader.drain() == []  # no Hello into a broken session


def test_connected_for_a_session_never_asked_for_is_misuse() -> None:
    pair = Pair()
    with pytest.raises(LocalProtocolError):
        pair.reader.connected(0.0, engine="nobody", rank=0, peer=HOLDER)
    with pytest.raises(LocalProtocolError):
        pair.reader.connect_failed(0.0, engine="nobody", rank=0)


def test_tracking_one_id_twice_is_misuse() -> None:
    pair = Pair(config=LeaseConfig())
    ticket = pair.grant_and_track(0.0)
    with pytest.raises(LocalProtocolError):
        pair.reader.track(1.0, request_id="r1", ticket=ticket)
