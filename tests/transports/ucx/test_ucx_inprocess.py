"""UcxTransport API contract, two endpoints in this process (real UCX over TCP)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from kvproto.transport import (
    BadMetadata,
    FrameTooLarge,
    MemoryNotRegistered,
    ReadCompleted,
    Received,
    TransportClosed,
    TransportEvent,
    UnknownPeer,
)
from kvproto_transports.conformance.hostmem import HostMemory
from kvproto_transports.ucx import (
    Backpressure,
    LayoutMismatch,
    RegistrationError,
    UcxTransport,
    ucx_available,
    unavailable_reason,
)

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not ucx_available(), reason=f"UCX: {unavailable_reason()}"),
]


@pytest.fixture
def make() -> Iterator[Callable[..., UcxTransport]]:
    made: list[UcxTransport] = []

    def new(**kwargs: object) -> UcxTransport:
        made.append(UcxTransport(**kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield new
    for t in made:
        t.close()


def _until(
    t: UcxTransport, pred: Callable[[list[TransportEvent]], bool], timeout_s: float = 5.0
) -> list[TransportEvent]:
    got: list[TransportEvent] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got.extend(t.poll())
        if pred(got):
            break
        time.sleep(0.001)
    return got


def test_identity_and_capabilities(make: Callable[..., UcxTransport]) -> None:
    a = make(name_prefix="node")
    assert a.name == "ucx"
    assert a.local_peer.startswith("node-")
    caps = a.capabilities
    assert caps.detects_peer_failure and caps.failure_detection_bound_s == 1.0
    assert caps.one_sided_reads
    quiet = make(probe_interval_s=None)
    assert not quiet.capabilities.detects_peer_failure
    assert quiet.capabilities.failure_detection_bound_s is None


def test_api_errors(make: Callable[..., UcxTransport]) -> None:
    a, b = make(max_notification_size=16), make()
    with pytest.raises(BadMetadata):
        a.add_peer(a.metadata())
    with pytest.raises(UnknownPeer):
        a.send(b.local_peer, b"never added")
    pb = a.add_peer(b.metadata())
    assert a.add_peer(b.metadata()) == pb == b.local_peer
    with pytest.raises(FrameTooLarge):
        a.send(pb, b"x" * 17)
    with pytest.raises(MemoryNotRegistered):  # nothing registered on either side
        a.read_blocks(pb, local_blocks=[0], remote_blocks=[0])
    a.send(pb, b"x" * 16)
    got = _until(b, bool)
    assert got == [Received(peer=a.local_peer, payload=b"x" * 16)]
    a.remove_peer(pb)
    a.remove_peer(pb)
    with pytest.raises(UnknownPeer):
        a.send(pb, b"removed")
    a.close()
    a.close()
    for call in (a.poll, a.metadata, lambda: a.send(pb, b"")):
        with pytest.raises(TransportClosed):
            call()


def test_backpressure_instead_of_blocking(make: Callable[..., UcxTransport]) -> None:
    a, b = make(max_pending_sends=4), make()
    pb = a.add_peer(b.metadata())
    refused = 0
    for k in range(50):  # the connection is not up yet: sends queue
        try:
            a.send(pb, b"%d" % k)
        except Backpressure:
            refused += 1
    assert refused > 0
    accepted = 50 - refused
    got = _until(b, lambda evs: len(evs) >= accepted)
    assert len(got) == accepted


def test_registration_and_layout_checks(make: Callable[..., UcxTransport]) -> None:
    mem_a, mem_b = HostMemory(), HostMemory()
    a, b = make(), make()
    pb = a.add_peer(b.metadata())  # b has not registered yet
    la = mem_a.allocate(num_regions=2, block_len=64, num_blocks=4)
    a.register_blocks(la)
    with pytest.raises(RegistrationError):
        a.register_blocks(la)
    with pytest.raises(MemoryNotRegistered):  # b advertised nothing
        a.read_blocks(pb, local_blocks=[0], remote_blocks=[0])
    lb = mem_b.allocate(num_regions=1, block_len=64, num_blocks=4)
    b.register_blocks(lb)
    assert a.add_peer(b.metadata()) == pb  # refreshed: now with b's layout and keys
    with pytest.raises(LayoutMismatch):  # 2 regions here, 1 there
        a.read_blocks(pb, local_blocks=[0], remote_blocks=[0])


def test_peer_that_registers_late_can_be_read_after_re_adding(
    make: Callable[..., UcxTransport],
) -> None:
    mem_a, mem_b = HostMemory(), HostMemory()
    a, b = make(), make()
    pb = a.add_peer(b.metadata())
    a.send(pb, b"warm")
    assert _until(b, bool)
    a.register_blocks(mem_a.allocate(num_regions=1, block_len=64, num_blocks=4))
    lb = mem_b.allocate(num_regions=1, block_len=64, num_blocks=4)
    mem_b.write_block(lb, 0, 3, bytes(range(64)))
    b.register_blocks(lb)
    a.add_peer(b.metadata())
    rid = a.read_blocks(pb, local_blocks=[1], remote_blocks=[3])
    got = _until(a, lambda evs: any(isinstance(e, ReadCompleted) for e in evs))
    assert ReadCompleted(read_id=rid) in got
    assert mem_a.read_block(a.layout, 0, 1) == bytes(range(64))  # type: ignore[arg-type]


def test_close_leaves_no_file_descriptors(make: Callable[..., UcxTransport]) -> None:
    import os

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    a = make()
    a.close()  # warm up one-time UCX state
    before = fds()
    for _ in range(3):
        x, y = make(), make()
        x.add_peer(y.metadata())  # closed while the connection is being set up
        y.add_peer(x.metadata())
        x.close()
        y.close()
    assert fds() <= before


def test_a_crashed_engine_reports_its_peers_lost_and_refuses_calls(
    make: Callable[..., UcxTransport],
) -> None:
    from kvproto.transport import PeerLost

    a, b = make(), make()
    pb = a.add_peer(b.metadata())
    a.send(pb, b"warm")
    assert _until(b, bool)

    def boom() -> None:
        raise RuntimeError("injected fault")

    a._engine._steps._receive = boom  # type: ignore[method-assign]  # its next step dies
    got = _until(a, lambda evs: any(isinstance(e, PeerLost) for e in evs))
    assert [e.peer for e in got if isinstance(e, PeerLost)] == [pb]
    with pytest.raises(TransportClosed, match="engine crashed"):
        a.send(pb, b"after the crash")


def test_sends_from_many_threads_while_both_sides_poll_arrive_once_each(
    make: Callable[..., UcxTransport],
) -> None:
    # Every call runs the engine's step on its own thread when the step is free,
    # and only queues when another thread holds it: no payload may be lost,
    # doubled or left waiting for the engine thread's idle wait.
    import threading

    a, b = make(idle_wait_ms=10_000), make(idle_wait_ms=10_000)
    pb = a.add_peer(b.metadata())
    per_thread, threads = 300, 4
    stop = threading.Event()

    def poll_a() -> None:  # a's events (none expected) are polled concurrently too
        while not stop.is_set():
            a.poll()
            time.sleep(0.0001)

    def send(k: int) -> None:
        for i in range(per_thread):
            a.send(pb, f"{k}:{i}".encode())

    poller = threading.Thread(target=poll_a)
    senders = [threading.Thread(target=send, args=(k,)) for k in range(threads)]
    poller.start()
    for s in senders:
        s.start()
    for s in senders:
        s.join(30)
    want = {f"{k}:{i}".encode() for k in range(threads) for i in range(per_thread)}
    got = _until(
        b,
        lambda evs: len([e for e in evs if isinstance(e, Received)]) >= len(want),
        timeout_s=5.0,  # far under the 10 s idle wait: the callers moved everything
    )
    stop.set()
    poller.join(5)
    payloads = [e.payload for e in got if isinstance(e, Received)]
    assert sorted(payloads) == sorted(want)
    assert a.stats.notifications_sent == len(want)
