"""Lease tickets: kv_transfer_params round trip and typed errors for anything else."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.config import LeaseConfig, LeaseParams
from kvproto.errors import LocalProtocolError, RemoteProtocolError
from kvproto.events import FailReason
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto.ticket import (
    MAX_HOLDER_TP,
    PROOF_BYTES,
    LeaseTicket,
    claim_proof,
    claim_prover,
    ticket_problem,
)

from .pair import counter_entropy


def make_ticket(**overrides: Any) -> LeaseTicket:
    fields: dict[str, Any] = {
        "holder_engine": "P",
        "holder_incarnation": 7,
        "holder_tp_size": 2,
        "lease": 42,
        "token": bytes(range(16)),
        "params": LeaseParams(duration=30, interval=5, extension=20),
        "expires_in": 30.0,
        "deadline": 1030.0,
        "request_id": "cmpl-abc-0",
    }
    fields.update(overrides)
    return LeaseTicket(**fields)


def test_round_trip_through_json() -> None:
    t = make_ticket()
    params = t.to_params()
    assert params["token"] == bytes(range(16)).hex()
    wire_form = json.loads(json.dumps({"kvproto": params}))  # through the proxy
    assert LeaseTicket.from_params(wire_form["kvproto"]) == t


def test_granted_ticket_round_trips() -> None:
    h = Holder(LeaseConfig(), engine="P", incarnation=3, entropy=counter_entropy())
    t = h.grant(100.0, request_id="req")
    assert t.expires_in == 20.0 and t.deadline == 120.0 and t.lease == 1  # the claim window
    assert LeaseTicket.from_params(t.to_params()) == t
    turn2 = h.grant(100.0, request_id="req2", ttl=480.0)
    assert turn2.deadline == 580.0 and turn2.lease == 2
    assert turn2.token != t.token


@settings(max_examples=150, deadline=None)
@given(
    engine=st.text(max_size=20),
    incarnation=st.integers(0, 2**64 - 1),
    tp=st.integers(1, MAX_HOLDER_TP),
    lease=st.integers(1, 2**64 - 1),
    token=st.binary(min_size=16, max_size=16),
    expires=st.floats(0.001, 1e6),
    deadline=st.floats(-1e9, 1e9),
    rid=st.text(max_size=40),
)
def test_round_trip_property(  # noqa: PLR0917 (hypothesis draws each field)
    engine: str,
    incarnation: int,
    tp: int,
    lease: int,
    token: bytes,
    expires: float,
    deadline: float,
    rid: str,
) -> None:
    t = make_ticket(
        holder_engine=engine,
        holder_incarnation=incarnation,
        holder_tp_size=tp,
        lease=lease,
        token=token,
        expires_in=expires,
        deadline=deadline,
        request_id=rid,
    )
    assert LeaseTicket.from_params(t.to_params()) == t


def params_with(**changes: Any) -> dict[str, Any]:
    p = make_ticket().to_params()
    for k, v in changes.items():
        if v is ...:
            del p[k]
        else:
            p[k] = v
    return p


@pytest.mark.parametrize(
    "bad",
    [
        params_with(token=...),
        params_with(token=None),
        params_with(token=b"0123456789abcdef"),
        params_with(token="zz" * 16),
        params_with(token="00" * 15),
        params_with(token="00" * 17),
        params_with(lease=0),
        params_with(lease=-1),
        params_with(lease=2**64),  # cannot be framed as uint64
        params_with(lease=True),
        params_with(lease="1"),
        params_with(lease=1.5),
        params_with(holder_tp_size=0),
        params_with(holder_tp_size=2**40),  # would open 2**40 sessions
        params_with(holder_incarnation=-1),
        params_with(holder_incarnation=2**64),
        params_with(holder_engine=...),
        params_with(holder_engine=5),
        params_with(params=[30, 0, 20]),
        params_with(params=[30, 5, 5]),
        params_with(params=[30, 5, math.nan]),
        params_with(params=[30, 5]),
        params_with(params="30,5,20"),
        params_with(expires_in=math.nan),
        params_with(expires_in=math.inf),
        params_with(expires_in=-1.0),
        params_with(expires_in=0.0),
        params_with(deadline=math.inf),
        params_with(deadline=-math.inf),
        params_with(request_id=5),
        {},
        {"token": "00" * 16},
    ],
)
def test_bad_params_are_a_remote_protocol_error(bad: dict[str, Any]) -> None:
    with pytest.raises(RemoteProtocolError):
        LeaseTicket.from_params(bad)


@pytest.mark.parametrize("field", ["duration", "interval", "extension", "expires_in", "deadline"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_each_non_finite_time_is_named(field: str, value: float) -> None:
    times: dict[str, float] = {"duration": 30, "interval": 5, "extension": 20}
    ticket_times: dict[str, float] = {"expires_in": 30.0, "deadline": 1030.0}
    (times if field in times else ticket_times)[field] = value
    ticket = make_ticket(params=LeaseParams(**times), **ticket_times)
    assert ticket_problem(ticket) == "non-finite time"


def test_finite_times_whose_sum_overflows_are_finite() -> None:
    # ticket_problem tests the times' sum first; an overflowing sum is no bad time.
    huge = 1e308
    ticket = make_ticket(
        params=LeaseParams(duration=huge, interval=5, extension=huge),
        expires_in=huge,
        deadline=huge,
    )
    assert not math.isfinite(huge + huge)
    assert ticket_problem(ticket) is None


@pytest.mark.parametrize("bad", [None, 5, "ticket", ["token"], b"\x00"])
def test_non_mapping_is_a_remote_protocol_error(bad: Any) -> None:
    with pytest.raises(RemoteProtocolError):
        LeaseTicket.from_params(bad)


def test_non_string_keys_are_a_remote_protocol_error() -> None:
    with pytest.raises(RemoteProtocolError):
        LeaseTicket.from_params({1: 2, "token": "00" * 16})


def test_unknown_keys_are_ignored_for_forward_compatibility() -> None:
    p = make_ticket().to_params()
    p["future_field"] = {"x": 1}
    assert LeaseTicket.from_params(p) == make_ticket()


def test_claim_proof_binds_token_engine_and_lease() -> None:
    token = bytes(16)
    proof = claim_proof(token, "D", 1)
    assert len(proof) == PROOF_BYTES
    assert proof == claim_proof(token, "D", 1)
    assert proof != claim_proof(bytes([1]) + bytes(15), "D", 1)
    assert proof != claim_proof(token, "E", 1)
    assert proof != claim_proof(token, "D", 2)
    # The engine id is delimited: "D" + lease cannot collide with "D\x00..." engines.
    assert claim_proof(token, "D\x00", 1) != proof


def test_the_holder_checks_claims_with_the_same_proof() -> None:
    tokens = [bytes(16), bytes([7]) * 16]
    for engine in ("D", "E\x00", "decode-7"):
        prove = claim_prover(engine)
        for token in tokens:
            for lease in (1, 2**64 - 1):
                assert prove(bytearray(token), lease) == claim_proof(token, engine, lease)


def test_reader_fails_an_unusable_ticket_instead_of_raising_later() -> None:
    """A ticket that bypassed from_params (lease beyond uint64, absurd TP) fails BAD_TICKET."""
    r = Reader(LeaseConfig(), engine="D", incarnation=1, tp_size=2, entropy=counter_entropy())
    r.track(0.0, request_id="a", ticket=make_ticket(lease=2**64))
    r.track(0.0, request_id="b", ticket=make_ticket(holder_tp_size=2**40))
    r.track(0.0, request_id="c", ticket=make_ticket(holder_tp_size=3))  # 2 and 3 do not divide
    failed = [(o.request_id, o.reason) for o in r.drain() if hasattr(o, "reason")]
    assert failed == [(x, FailReason.BAD_TICKET) for x in "abc"]
    r.handle_timer(100.0)  # nothing left that could fail to encode
    assert r.get_timer() is None


def test_holder_refuses_bad_tickets_and_ttls_locally() -> None:
    h = Holder(LeaseConfig(), engine="P", incarnation=7, tp_size=2)
    with pytest.raises(LocalProtocolError):
        h.adopt(0.0, make_ticket(holder_engine="Q"))
    with pytest.raises(LocalProtocolError):
        h.adopt(0.0, make_ticket(holder_incarnation=8))
    with pytest.raises(LocalProtocolError):
        h.adopt(0.0, make_ticket(expires_in=math.nan))
    for ttl in (0.0, -1.0, math.nan, math.inf, 1801.0):
        with pytest.raises(LocalProtocolError):
            h.grant(0.0, request_id=f"r{ttl}", ttl=ttl)
    h.adopt(0.0, make_ticket())
    with pytest.raises(LocalProtocolError):
        h.adopt(0.0, make_ticket())  # same lease twice
    with pytest.raises(LocalProtocolError):
        h.adopt(0.0, make_ticket(lease=43))  # same request id twice
