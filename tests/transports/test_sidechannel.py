"""The ZMQ handshake side channel: real sockets on localhost, no transport involved."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvproto_binding.sidechannel import (
    AuthenticationFailed,
    CircuitOpen,
    CompatMismatch,
    HandshakeClient,
    HandshakeFailed,
    HandshakeResult,
    HandshakeSucceeded,
    HandshakeTimeout,
    ServerRefused,
    SideChannelServer,
    fetch_metadata,
    wire,
)

HOST = "127.0.0.1"
COMPAT = b"compat-v1" * 4


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    srv = SideChannelServer(host=HOST, base_port=0, compat_hash=COMPAT)
    srv.set_metadata(0, b"meta-rank-0\x00\xff")
    srv.set_metadata(1, b"meta-rank-1")
    yield srv
    srv.close()


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _free_port() -> int:
    """A port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _wait_results(
    client: HandshakeClient, n: int, timeout_s: float = 10.0
) -> list[HandshakeResult]:
    out: list[HandshakeResult] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += client.poll_results()
        time.sleep(0.005)
    return out


def test_round_trips_return_metadata_and_ordered_clock_samples(
    server: SideChannelServer, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    reply = fetch_metadata(
        ctx, HOST, server.port, 0, requester="reader-a", compat_hash=COMPAT, rounds=4
    )
    assert reply.metadata == b"meta-rank-0\x00\xff"
    assert reply.rank == 0
    assert len(reply.samples) == 4
    # Same host: both sides read CLOCK_MONOTONIC, so the holder's reading lies inside our RTT.
    for s in reply.samples:
        assert s.send_time <= s.peer_monotonic_time <= s.recv_time
        assert abs(s.offset) <= s.rtt / 2 + 1e-6
    assert reply.best_sample().rtt == min(s.rtt for s in reply.samples)
    assert server.stats().replies_ok == 4


def test_compat_mismatch_is_typed_and_counted(
    server: SideChannelServer, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    with pytest.raises(CompatMismatch) as info:
        fetch_metadata(ctx, HOST, server.port, 0, requester="r", compat_hash=b"other")
    assert info.value.theirs == COMPAT
    assert server.stats().compat_mismatch == 1
    assert server.stats().replies_ok == 0


def test_unknown_rank_is_refused(
    server: SideChannelServer, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    with pytest.raises(ServerRefused) as info:
        fetch_metadata(ctx, HOST, server.port, 7, requester="r", compat_hash=COMPAT)
    assert info.value.code == wire.ERR_UNKNOWN_RANK
    assert info.value.retryable
    assert server.stats().unknown_rank == 1


def test_shared_secret_authenticates_both_directions(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    srv = SideChannelServer(host=HOST, base_port=0, compat_hash=COMPAT, secret=b"s3cret")
    srv.set_metadata(0, b"m")
    try:
        ok = fetch_metadata(
            ctx, HOST, srv.port, 0, requester="r", compat_hash=COMPAT, secret=b"s3cret"
        )
        assert ok.metadata == b"m"
        for secret in (b"wrong", None):
            with pytest.raises(AuthenticationFailed):
                fetch_metadata(
                    ctx, HOST, srv.port, 0, requester="r", compat_hash=COMPAT, secret=secret
                )
        assert srv.stats().auth_failed == 2
        # A client that expects a MAC rejects an unauthenticated server.
        plain = SideChannelServer(host=HOST, base_port=0, compat_hash=COMPAT)
        plain.set_metadata(0, b"m")
        try:
            with pytest.raises(AuthenticationFailed):
                fetch_metadata(
                    ctx, HOST, plain.port, 0, requester="r", compat_hash=COMPAT, secret=b"s3cret"
                )
        finally:
            plain.close()
    finally:
        srv.close()


def test_hostile_frames_are_answered_or_dropped_and_the_listener_survives(
    server: SideChannelServer, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.connect(f"tcp://{HOST}:{server.port}")
    junk: list[list[bytes]] = [
        [b"", b"\xff\xfe not msgpack"],
        [b"", b""],
        [b""],
        [b"", b"a", b"b", b"c"],
        [b"", msgspec.msgpack.encode({"rank": "zero"})],
        [b"", msgspec.msgpack.encode(["get_meta_msg", 0, 0])],  # vLLM's request shape
        [
            b"",
            msgspec.msgpack.encode(
                {"version": 99, "kind": "get_meta", "rank": 0, "requester": "x", "nonce": b"n"}
            ),
        ],
        [b"", b"x" * (wire.MAX_FRAME_BYTES + 1)],
        [
            b"",
            msgspec.msgpack.encode(
                {"version": 1, "kind": "get_meta", "rank": 2**62, "requester": "x", "nonce": b"n"}
            ),
        ],
    ]
    for frames in junk:
        bad.send_multipart(frames)
    answered = 0
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and answered < 8:
        if bad.poll(100):
            frames = bad.recv_multipart()
            reply = wire.reply_decoder.decode(frames[-1])
            assert not reply.ok and reply.metadata == b""
            answered += 1
    bad.close()
    assert answered == 8  # everything but the oversize frame got an error reply
    stats = server.stats()
    assert stats.malformed >= 5
    assert stats.oversize == 1
    assert stats.bad_version == 1
    assert stats.unknown_rank == 1
    assert stats.internal_errors == 0
    assert server.alive()
    good = fetch_metadata(ctx, HOST, server.port, 1, requester="r", compat_hash=COMPAT, rounds=1)
    assert good.metadata == b"meta-rank-1"


def test_introductions_reach_the_holder(
    server: SideChannelServer, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    fetch_metadata(
        ctx,
        HOST,
        server.port,
        1,
        requester="reader-7",
        compat_hash=COMPAT,
        requester_metadata=b"reader-md",
        rounds=3,
    )
    intros = server.poll_introductions()
    assert [(i.requester, i.rank, i.metadata) for i in intros] == [("reader-7", 1, b"reader-md")]
    assert server.poll_introductions() == []


def test_a_registration_rides_the_first_round_trip_of_a_handshake(
    server: SideChannelServer,
) -> None:
    """Push mode: a decoder's registration reaches the writer's owner with its
    introduction, once (the later rounds are clock samples)."""
    client = HandshakeClient(requester="decoder-3", compat_hash=COMPAT, requester_metadata=b"md")
    try:
        assert client.submit("reg", HOST, server.port, 1, registration=b"blocks 4 5")
        (result,) = _wait_results(client, 1)
        assert isinstance(result, HandshakeSucceeded)
    finally:
        client.close()
    intros = server.poll_introductions()
    assert [(i.requester, i.rank, i.metadata, i.registration) for i in intros] == [
        ("decoder-3", 1, b"md", b"blocks 4 5")
    ]


def test_a_dead_holder_never_delays_a_live_one(server: SideChannelServer) -> None:
    client = HandshakeClient(
        requester="r",
        compat_hash=COMPAT,
        timeout_s=0.4,
        max_attempts=2,
        backoff_initial_s=0.05,
        breaker_threshold=1,
        breaker_cooldown_s=30.0,
    )
    dead_port = _free_port()
    try:
        t0 = time.monotonic()
        assert client.submit("dead", HOST, dead_port, 0)
        assert not client.submit("dead", HOST, dead_port, 0)  # already pending
        assert client.submit("live", HOST, server.port, 0)
        first = _wait_results(client, 1)
        live_latency = time.monotonic() - t0
        assert [r.peer_key for r in first] == ["live"]
        assert isinstance(first[0], HandshakeSucceeded)
        assert live_latency < 0.4  # did not wait for the dead holder's timeout
        assert client.pending() == {"dead"}
        (dead,) = _wait_results(client, 1)
        assert isinstance(dead, HandshakeFailed)
        assert isinstance(dead.error, HandshakeTimeout)
        assert dead.attempts == 2
        # The breaker is open now: a new attempt fails at once without a thread.
        assert not client.submit("dead-again", HOST, dead_port, 1)
        (refused,) = client.poll_results()
        assert isinstance(refused, HandshakeFailed) and isinstance(refused.error, CircuitOpen)
        assert refused.attempts == 0
        print(f"\nlive handshake done in {live_latency * 1000:.1f} ms beside a dead holder")
    finally:
        client.close()


def test_compat_mismatch_is_not_retried() -> None:
    srv = SideChannelServer(host=HOST, base_port=0, compat_hash=b"theirs")
    srv.set_metadata(0, b"m")
    client = HandshakeClient(requester="r", compat_hash=b"ours", max_attempts=5)
    try:
        client.submit(("engine", 0), HOST, srv.port, 0)
        (result,) = _wait_results(client, 1)
        assert isinstance(result, HandshakeFailed)
        assert isinstance(result.error, CompatMismatch)
        assert result.attempts == 1
    finally:
        client.close()
        srv.close()


def test_port_is_base_plus_dp_rank() -> None:
    base = _free_port()
    # Find a base where base+2 is free too (rarely not).
    srv = SideChannelServer(host=HOST, base_port=base - 2, dp_rank=2, compat_hash=COMPAT)
    try:
        assert srv.port == base
    finally:
        srv.close()
