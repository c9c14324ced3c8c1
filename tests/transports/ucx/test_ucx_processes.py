"""Two processes on localhost over TCP: notifications, reads, notify ordering, junk frames."""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING

import pytest

from kvproto import wire
from kvproto.errors import RemoteProtocolError
from kvproto.transport import ReadCompleted, Received
from kvproto_transports.ucx import DEFAULT_MAX_NOTIFICATION_SIZE, ucx_available, unavailable_reason
from tests.transports.ucx.node import NodeError, UcxNode, block_pattern

if TYPE_CHECKING:
    from conftest import Pair

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not ucx_available(), reason=f"UCX: {unavailable_reason()}"),
]

BLOCK = 4096
SEED = 7


def _received(node: UcxNode, count: int, timeout_s: float = 10.0) -> list[Received]:
    got = node.call("wait_events", count=count, kinds=("Received",), timeout_s=timeout_s)
    return [ev for _t, ev in got]


def _read_done(node: UcxNode, read_id: int, timeout_s: float = 10.0) -> list[object]:
    got = node.call(
        "wait_events", count=1, kinds=("ReadCompleted", "ReadFailed"), timeout_s=timeout_s
    )
    evs = [ev for _t, ev in got]
    assert evs, f"read {read_id}: no completion within {timeout_s} s"
    assert evs[0].read_id == read_id  # type: ignore[attr-defined]
    return evs


PAYLOADS = [
    b"",
    b"\x00",
    b"\x00\x00nul inside\x00",
    b"\xff\xfe\x80\xc3\x28 not utf-8",
    bytes(range(256)),
    b"\r\n\r\n",
    os.urandom(8192),  # above UCX's rendezvous threshold (8 KiB)
    b"x" * DEFAULT_MAX_NOTIFICATION_SIZE,  # exactly the declared maximum
]


def test_notifications_are_byte_exact_both_ways(pair: Pair) -> None:
    pair.reader.call("send_many", peer=pair.holder_id, payloads=PAYLOADS)
    pair.holder.call("send_many", peer=pair.reader_id, payloads=PAYLOADS)
    at_holder = _received(pair.holder, len(PAYLOADS))
    at_reader = _received(pair.reader, len(PAYLOADS))
    assert sorted(r.payload for r in at_holder) == sorted(PAYLOADS)
    assert sorted(r.payload for r in at_reader) == sorted(PAYLOADS)
    assert {r.peer for r in at_holder} == {pair.reader_id}
    assert {r.peer for r in at_reader} == {pair.holder_id}


def test_oversize_is_refused_at_send_never_truncated(pair: Pair) -> None:
    big = b"y" * (DEFAULT_MAX_NOTIFICATION_SIZE + 1)
    with pytest.raises(NodeError) as err:
        pair.reader.call("send", peer=pair.holder_id, payload=big)
    assert err.value.kind == "FrameTooLarge"
    pair.reader.call("send", peer=pair.holder_id, payload=b"after-oversize")
    got = _received(pair.holder, 1)
    assert [r.payload for r in got] == [b"after-oversize"]  # nothing truncated came first


def test_junk_frames_are_just_bytes_and_the_core_drops_them(pair: Pair) -> None:
    rng = random.Random(9)
    good = wire.encode(wire.Heartbeat(seq=1, claims=[], aborts=[], count=0, digest=0))
    junk = [
        good[:-1],  # truncated frame
        wire.MAGIC + b"\x63\x00" + good[4:],  # unknown version
        wire.MAGIC + b"\x01\x80" + good[4:],  # unknown flag
        wire.MAGIC + bytes([1, 0]) + b"\xc1\xc1\xc1",  # invalid msgpack
        b"HB:\xff\xfe,\x00",  # a broken legacy text frame
        bytes(rng.randrange(256) for _ in range(333)),
    ]
    pair.reader.call("send_many", peer=pair.holder_id, payloads=[*junk, good])
    got = [r.payload for r in _received(pair.holder, len(junk) + 1)]
    assert sorted(got) == sorted([*junk, good])  # the transport delivers every byte as sent
    decoded = 0
    for payload in got:
        if payload == good:
            assert wire.decode(payload) == wire.decode(good)
            decoded += 1
        else:
            with pytest.raises(RemoteProtocolError):  # ...and the core refuses the junk
                wire.decode(payload)
    assert decoded == 1


def _expected(remote_block: int, region: int) -> bytes:
    return block_pattern(SEED, region, remote_block, BLOCK)


def test_64_block_read_delivers_exact_bytes(pair: Pair) -> None:
    local = list(range(0, 64))
    remote = list(range(16, 80))
    rid = pair.reader.call(
        "read", peer=pair.holder_id, local_blocks=local, remote_blocks=remote, notify=b"done-64"
    )
    assert [type(e) for e in _read_done(pair.reader, rid)] == [ReadCompleted]
    for region in range(2):
        for lb, rb in zip(local, remote, strict=True):
            assert pair.reader.call("block", region=region, block=lb) == _expected(rb, region)
    assert [r.payload for r in _received(pair.holder, 1)] == [b"done-64"]
    stats = pair.reader.call("stats")
    assert stats.gets_issued >= 2  # contiguous blocks merged: one get per region


def test_scattered_and_sliced_reads(pair: Pair) -> None:
    rid = pair.reader.call(
        "read", peer=pair.holder_id, local_blocks=[70, 72, 71], remote_blocks=[3, 1, 2]
    )
    assert [type(e) for e in _read_done(pair.reader, rid)] == [ReadCompleted]
    for region in range(2):
        for lb, rb in ((70, 3), (72, 1), (71, 2)):
            assert pair.reader.call("block", region=region, block=lb) == _expected(rb, region)
    # Second half of remote block 5 into the second half of local block 75 (TP slices).
    before = pair.reader.call("block", region=0, block=75)
    rid = pair.reader.call(
        "read",
        peer=pair.holder_id,
        local_blocks=[75],
        remote_blocks=[5],
        local_slice=(1, 2),
        remote_slice=(1, 2),
    )
    assert [type(e) for e in _read_done(pair.reader, rid)] == [ReadCompleted]
    got = pair.reader.call("block", region=0, block=75)
    half = BLOCK // 2
    assert got[:half] == before[:half]
    assert got[half:] == _expected(5, 0)[half:]


def test_notify_reaches_the_holder_only_after_the_data(pair: Pair) -> None:
    # The holder frees and reuses the blocks the moment it sees a notify (scribbles
    # 0xEE over them). If a notify arrived before its data left, the reader would
    # see 0xEE.
    plans = [([40 + i], [60 + i], b"free-%d" % i) for i in range(8)]
    for _local, remote, note in plans:
        pair.holder.call("set_scribble", notify=note, blocks=remote)
    rids = [
        pair.reader.call(
            "read", peer=pair.holder_id, local_blocks=local, remote_blocks=remote, notify=note
        )
        for local, remote, note in plans
    ]
    got = pair.reader.call("wait_events", count=len(rids), kinds=("ReadCompleted", "ReadFailed"))
    assert sorted(ev.read_id for _t, ev in got) == sorted(rids)
    assert all(isinstance(ev, ReadCompleted) for _t, ev in got)
    assert sorted(r.payload for r in _received(pair.holder, len(plans))) == sorted(
        note for _l, _r, note in plans
    )
    for local, remote, _note in plans:
        for region in range(2):
            assert pair.reader.call("block", region=region, block=local[0]) == _expected(
                remote[0], region
            )
            # ...and the holder did overwrite them after the notify.
            assert pair.holder.call("block", region=region, block=remote[0]) == b"\xee" * BLOCK


def test_zero_block_read_completes_and_notifies(pair: Pair) -> None:
    rid = pair.reader.call(
        "read", peer=pair.holder_id, local_blocks=[], remote_blocks=[], notify=b"prefix-hit"
    )
    assert [type(e) for e in _read_done(pair.reader, rid)] == [ReadCompleted]
    assert [r.payload for r in _received(pair.holder, 1)] == [b"prefix-hit"]


def test_out_of_range_read_is_refused_before_anything_moves(pair: Pair) -> None:
    # A UCP get outside the holder's registered memory crashed the holder in a
    # probe; the transport checks against the advertised layout first.
    with pytest.raises(NodeError) as err:
        pair.reader.call("read", peer=pair.holder_id, local_blocks=[0], remote_blocks=[80])
    assert err.value.kind == "MemoryNotRegistered"
    pair.reader.call("send", peer=pair.holder_id, payload=b"still-alive")
    assert [r.payload for r in _received(pair.holder, 1)] == [b"still-alive"]
