"""The stock-vLLM text codec: exact round trips, encoders refuse what the stock parser
misreads, the parser is total (a frame or RemoteProtocolError)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvproto import legacy
from kvproto.errors import LocalProtocolError, RemoteProtocolError
from kvproto.legacy import LegacyDone, LegacyHeartbeat


def test_vllm_formats_exactly() -> None:
    assert legacy.encode_heartbeat(["cmpl-1", "cmpl-2"]) == b"HB:cmpl-1,cmpl-2"
    assert legacy.encode_heartbeat([]) == b"HB:"
    assert legacy.encode_done("cmpl-1", 2) == b"cmpl-1:2"
    assert legacy.parse(b"HB:a,b,c") == LegacyHeartbeat(request_ids=("a", "b", "c"))
    assert legacy.parse(b"HB:") == LegacyHeartbeat(request_ids=())
    assert legacy.parse(b"cmpl-1:2") == LegacyDone(request_id="cmpl-1", expected=2)


def test_ids_with_colons_parse_like_vllms_rsplit() -> None:
    assert legacy.parse(b"chat:abc:def:4") == LegacyDone(request_id="chat:abc:def", expected=4)
    assert legacy.encode_done("a:b", 1) == b"a:b:1"
    assert legacy.parse(b"HB:x:1,y") == LegacyHeartbeat(request_ids=("x:1", "y"))


@pytest.mark.parametrize("bad_id", ["a,b", ",", "HB:x", "HB:", "HB", "", "\ud800"])
def test_encoders_refuse_ids_the_stock_parser_would_misread(bad_id: str) -> None:
    with pytest.raises(LocalProtocolError):
        legacy.encode_heartbeat(["ok", bad_id])
    with pytest.raises(LocalProtocolError):
        legacy.encode_done(bad_id, 1)


@pytest.mark.parametrize("count", [0, -1, legacy.MAX_CONSUMERS + 1])
def test_encode_done_refuses_bad_counts(count: int) -> None:
    with pytest.raises(LocalProtocolError):
        legacy.encode_done("a", count)


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xfe",  # not UTF-8
        b"HB:\xc3",  # truncated UTF-8
        b"cmpl-1",  # no colon
        b":2",  # empty id
        b"cmpl-1:",  # empty count
        b"cmpl-1:x",  # not an integer
        b"cmpl-1:-1",
        b"cmpl-1:+1",
        b"cmpl-1: 1",
        b"cmpl-1:1.0",
        b"cmpl-1:0",
        b"cmpl-1:65537",
        "cmpl-1:\u0661".encode(),  # an Arabic-Indic digit: isdigit() but not ASCII
        "cmpl-1:\u00b2".encode(),  # superscript two
        b"cmpl-1:" + b"9" * 5000,  # more digits than int() accepts (ValueError)
        b"cmpl-1:" + b"0" * 5000 + b"1",
        b"HB:a,,b",
        b"HB:,",
        b"HB:a,",
        b"",
    ],
)
def test_malformed_frames_are_remote_protocol_errors(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        legacy.parse(data)


legacy_id = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters=","),
    min_size=1,
    max_size=30,
).filter(lambda s: not s.startswith("HB:") and s != "HB")


@settings(max_examples=300, deadline=None)
@given(st.lists(legacy_id, max_size=10))
def test_heartbeat_round_trip(ids: list[str]) -> None:
    assert legacy.parse(legacy.encode_heartbeat(ids)) == LegacyHeartbeat(request_ids=tuple(ids))


@settings(max_examples=300, deadline=None)
@given(legacy_id, st.integers(1, legacy.MAX_CONSUMERS))
@example("HBx", 1)
@example("a:", 3)
def test_done_round_trip(request_id: str, expected: int) -> None:
    assert legacy.parse(legacy.encode_done(request_id, expected)) == LegacyDone(
        request_id=request_id, expected=expected
    )


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=80))
@example(b"HB:" + b"\x00")
@example(b"x:" + b"1" * 4301)
def test_parse_is_total_on_random_bytes(data: bytes) -> None:
    try:
        frame = legacy.parse(data)
    except RemoteProtocolError:
        return
    assert isinstance(frame, (LegacyHeartbeat, LegacyDone))
    if isinstance(frame, LegacyDone):
        assert 1 <= frame.expected <= legacy.MAX_CONSUMERS and frame.request_id


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=60))
def test_parse_is_total_on_random_text(text: str) -> None:
    try:
        data = text.encode("utf-8", "surrogatepass")
    except UnicodeEncodeError:  # pragma: no cover
        return
    with contextlib.suppress(RemoteProtocolError):
        legacy.parse(data)
