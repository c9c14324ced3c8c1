"""The transition tables: every (state, input) pair either has a row or raises
LocalProtocolError, and the rows themselves keep the safety invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.errors import LocalProtocolError
from kvproto.states import (
    DONE_ACK_ACTIONS,
    DONE_VERDICTS,
    LEASE_TRANSITIONS,
    PEER_SESSION_TRANSITIONS,
    READ_TRANSITIONS,
    SESSION_TRANSITIONS,
    DoneAckAction,
    LeaseInput,
    LeaseState,
    PeerSessionInput,
    PeerSessionState,
    ReadInput,
    ReadState,
    SessionInput,
    SessionState,
    done_ack_action,
    done_verdict,
    lease_next,
    peer_session_next,
    read_next,
    session_next,
)
from kvproto.wire import DoneVerdict

TABLES = [
    (LeaseState, LeaseInput, LEASE_TRANSITIONS, lease_next),
    (ReadState, ReadInput, READ_TRANSITIONS, read_next),
    (SessionState, SessionInput, SESSION_TRANSITIONS, session_next),
    (PeerSessionState, PeerSessionInput, PEER_SESSION_TRANSITIONS, peer_session_next),
]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(TABLES).flatmap(
        lambda t: st.tuples(st.just(t), st.sampled_from(list(t[0])), st.sampled_from(list(t[1])))
    )
)
def test_every_pair_has_a_row_or_raises(case: tuple) -> None:  # type: ignore[type-arg]
    (_, _, table, step), state, event = case
    if (state, event) in table:
        assert step(state, event) is table[(state, event)]
    else:
        with pytest.raises(LocalProtocolError):
            step(state, event)


@pytest.mark.parametrize(("states", "inputs", "table", "step"), TABLES)
def test_exhaustively_no_silence(states, inputs, table, step) -> None:  # type: ignore[no-untyped-def]
    rows = 0
    for s in states:
        for i in inputs:
            try:
                out = step(s, i)
            except LocalProtocolError:
                assert (s, i) not in table
                continue
            rows += 1
            assert out is table[(s, i)] and isinstance(out, states)
    assert rows == len(table)
    assert all(isinstance(s, states) and isinstance(i, inputs) for s, i in table)


def test_no_resurrection_in_the_lease_table() -> None:
    for (state, _), new in LEASE_TRANSITIONS.items():
        if state.terminal:
            assert new is state, f"{state} -> {new}"


def test_every_live_lease_state_can_end_every_way() -> None:
    for live in (LeaseState.GRANTED, LeaseState.HELD):
        assert lease_next(live, LeaseInput.DEADLINE) is LeaseState.EXPIRED
        assert lease_next(live, LeaseInput.REVOKE) is LeaseState.REVOKED
        assert lease_next(live, LeaseInput.PEER_LOST) is LeaseState.REVOKED
        assert lease_next(live, LeaseInput.ABORT) is LeaseState.ABORTED
        assert lease_next(live, LeaseInput.LAST_DONE) is LeaseState.RELEASED
        assert lease_next(live, LeaseInput.DONE) is LeaseState.HELD
        assert lease_next(live, LeaseInput.CLAIM) is LeaseState.HELD


def test_local_inputs_on_an_ended_lease_are_bugs_remote_ones_are_late() -> None:
    for ended in (s for s in LeaseState if s.terminal):
        for local in (LeaseInput.DEADLINE, LeaseInput.REVOKE, LeaseInput.PEER_LOST):
            with pytest.raises(LocalProtocolError):
                lease_next(ended, local)
        for remote in (LeaseInput.CLAIM, LeaseInput.DONE, LeaseInput.LAST_DONE, LeaseInput.ABORT):
            assert lease_next(ended, remote) is ended


READ_ORDER = [
    ReadState.TRACKED,
    ReadState.CLAIMED,
    ReadState.READING,
    ReadState.AWAITING_ACK,
    ReadState.CONFIRMED,
]


def test_reads_only_move_forward() -> None:
    terminal = {ReadState.CONFIRMED, ReadState.FAILED, ReadState.FINISHED}
    for (state, event), new in READ_TRANSITIONS.items():
        if state in READ_ORDER and new in READ_ORDER:
            assert READ_ORDER.index(new) >= READ_ORDER.index(state), (state, event, new)
        if state in (ReadState.FAILED, ReadState.FINISHED):
            assert new is state, (state, event, new)
        if state is ReadState.CONFIRMED:
            assert new in terminal


def test_confirmed_only_through_an_ack_after_the_read() -> None:
    """ReadConfirmed is reachable only as AWAITING_ACK --ACK_HELD--> CONFIRMED."""
    into = [(s, i) for (s, i), new in READ_TRANSITIONS.items() if new is ReadState.CONFIRMED]
    assert [(s, i) for s, i in into if s is not ReadState.CONFIRMED] == [
        (ReadState.AWAITING_ACK, ReadInput.ACK_HELD)
    ]
    # A HELD verdict that overtakes the local completion does not confirm by itself.
    assert read_next(ReadState.READING, ReadInput.ACK_HELD) is ReadState.READING


def test_every_unfinished_read_can_fail_or_finish() -> None:
    for s in (ReadState.TRACKED, ReadState.CLAIMED, ReadState.READING, ReadState.AWAITING_ACK):
        assert read_next(s, ReadInput.FAIL) is ReadState.FAILED
        assert read_next(s, ReadInput.FINISH) is ReadState.FINISHED


def test_every_session_can_be_lost_and_reopened() -> None:
    for s in SessionState:
        if s is SessionState.IDLE:
            assert session_next(s, SessionInput.LOST) is SessionState.IDLE
            continue
        assert session_next(s, SessionInput.LOST) is SessionState.BROKEN
    assert session_next(SessionState.BROKEN, SessionInput.NEED) is SessionState.CONNECTING
    assert session_next(SessionState.OPEN, SessionInput.REJECTED) is SessionState.HELLO_SENT


DONE_INPUTS = (
    LeaseInput.DONE,
    LeaseInput.LAST_DONE,
    LeaseInput.DUPLICATE_DONE,
    LeaseInput.FOREIGN_DONE,
)


def test_every_done_row_has_a_verdict_and_every_verdict_a_row() -> None:
    done_rows = {(s, i) for (s, i) in LEASE_TRANSITIONS if i in DONE_INPUTS}
    assert set(DONE_VERDICTS) == done_rows
    for state in LeaseState:
        for event in LeaseInput:
            if (state, event) in DONE_VERDICTS:
                assert done_verdict(state, event) is DONE_VERDICTS[(state, event)]
            else:
                with pytest.raises(LocalProtocolError):
                    done_verdict(state, event)


def test_held_is_only_vouched_for_by_a_live_lease_or_the_release_it_caused() -> None:
    for (state, event), verdict in DONE_VERDICTS.items():
        if verdict is DoneVerdict.HELD:
            assert not state.terminal or (
                state is LeaseState.RELEASED and event is LeaseInput.DUPLICATE_DONE
            ), (state, event)
        if event is LeaseInput.FOREIGN_DONE:
            assert verdict is DoneVerdict.REFUSED
            assert LEASE_TRANSITIONS[(state, event)] is state  # never counts


def test_the_reader_has_an_answer_to_every_verdict_in_every_read_state() -> None:
    # A DoneAck is peer input: no (state, verdict) pair may raise.
    assert set(DONE_ACK_ACTIONS) == {(s, v) for s in ReadState for v in DoneVerdict}
    for (state, verdict), action in DONE_ACK_ACTIONS.items():
        assert done_ack_action(state, verdict) is action
        started = state in (ReadState.READING, ReadState.AWAITING_ACK)
        assert (action is DoneAckAction.IGNORE) is not started, (state, verdict)
        if action is DoneAckAction.CONFIRM:  # only a finished read is confirmed, by HELD
            assert verdict is DoneVerdict.HELD
            assert read_next(state, ReadInput.ACK_HELD) is ReadState.CONFIRMED
        if action is DoneAckAction.REMEMBER_HELD:
            assert verdict is DoneVerdict.HELD
            assert read_next(state, ReadInput.ACK_HELD) is state


def test_a_peer_session_opens_only_from_absent_and_every_one_can_be_lost() -> None:
    into_open = [k for k, v in PEER_SESSION_TRANSITIONS.items() if v is PeerSessionState.OPEN]
    assert [s for s, _ in into_open if s is PeerSessionState.ABSENT] == [PeerSessionState.ABSENT]
    for state in PeerSessionState:
        assert peer_session_next(state, PeerSessionInput.LOST) is PeerSessionState.ABSENT
    assert (
        peer_session_next(PeerSessionState.OPEN, PeerSessionInput.RESTARTED)
        is PeerSessionState.ABSENT
    )
