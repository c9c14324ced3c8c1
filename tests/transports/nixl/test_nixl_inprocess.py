"""NixlTransport semantics with two real NIXL agents in one process (numpy-backed DRAM)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import numpy as np
import pytest

from kvproto.tpmath import BlockLayout, BlockSlice
from kvproto.transport import (
    BadMetadata,
    FrameTooLarge,
    MemoryNotRegistered,
    PeerLost,
    ReadCompleted,
    ReadFailed,
    Received,
    ThreadAffinity,
    Transport,
    TransportClosed,
    TransportEvent,
    UnknownPeer,
)
from kvproto_transports.nixl import (
    PROBE_PAYLOAD,
    LayoutMismatch,
    NixlTransport,
    RegistrationError,
    WrongThread,
    nixl_available,
)
from kvproto_transports.nixl import wire as nixl_wire

AVAILABLE, WHY = nixl_available()
pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not AVAILABLE, reason=f"NIXL: {WHY}")]

REGIONS, BLOCKS, BLOCK_LEN = 4, 16, 256


def _memory(fill: int | None) -> np.ndarray:
    if fill is None:
        return np.zeros((REGIONS, BLOCKS, BLOCK_LEN), dtype=np.uint8)
    rng = np.random.default_rng(fill)
    return rng.integers(0, 256, size=(REGIONS, BLOCKS, BLOCK_LEN), dtype=np.uint8)


def _layout(mem: np.ndarray, block_len: int = BLOCK_LEN) -> BlockLayout:
    base = mem.ctypes.data
    return BlockLayout(
        region_addrs=tuple(base + r * BLOCKS * block_len for r in range(REGIONS)),
        block_lens=(block_len,) * REGIONS,
        num_blocks=BLOCKS,
    )


def _pump(
    transports: Sequence[NixlTransport],
    until: Callable[[], bool],
    sink: dict[str, list[TransportEvent]],
    timeout_s: float = 5.0,
) -> None:
    """Poll every endpoint until ``until()``: without NIXL's progress thread
    (as here) both sides must poll for a message or a READ to move."""
    deadline = time.monotonic() + timeout_s
    while True:
        for t in transports:
            sink.setdefault(t.local_peer, []).extend(t.poll())
        if until():
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out; saw {sink}")
        time.sleep(0.0005)


class Pair:
    def __init__(self) -> None:
        self.holder = NixlTransport(name_prefix="h", progress_thread=False)
        self.reader = NixlTransport(name_prefix="r", progress_thread=False)
        self.hmem = _memory(fill=1)
        self.rmem = _memory(fill=None)
        self.holder.register_blocks(_layout(self.hmem))
        self.reader.register_blocks(_layout(self.rmem))
        self.hpeer = self.reader.add_peer(self.holder.metadata())
        self.rpeer = self.holder.add_peer(self.reader.metadata())
        self.events: dict[str, list[TransportEvent]] = {}

    @property
    def holder_events(self) -> list[TransportEvent]:
        return self.events.setdefault(self.hpeer, [])

    @property
    def reader_events(self) -> list[TransportEvent]:
        return self.events.setdefault(self.rpeer, [])

    def pump(self, until: Callable[[], bool], *extra: NixlTransport) -> None:
        _pump([self.holder, self.reader, *extra], until, self.events)

    def received(self) -> list[bytes]:
        return [e.payload for e in self.holder_events if isinstance(e, Received)]

    def read(self, local: Sequence[int], remote: Sequence[int], **kw: Any) -> list[TransportEvent]:
        rid = self.reader.read_blocks(self.hpeer, local_blocks=local, remote_blocks=remote, **kw)

        def done() -> bool:
            return any(
                isinstance(e, (ReadCompleted, ReadFailed)) and e.read_id == rid
                for e in self.reader_events
            )

        self.pump(done)
        return [e for e in self.reader_events if getattr(e, "read_id", None) == rid]

    def close(self) -> None:
        self.reader.close()
        self.holder.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def test_is_a_transport_with_honest_capabilities(pair: Pair) -> None:
    assert isinstance(pair.holder, Transport)
    caps = pair.holder.capabilities
    assert caps.thread_affinity is ThreadAffinity.OWNER
    assert caps.detects_peer_failure and caps.one_sided_reads
    assert pair.holder.name == "nixl"
    assert pair.holder.local_peer != pair.reader.local_peer
    assert pair.hpeer == pair.holder.local_peer


def test_one_read_covers_every_region_and_the_notification_follows(pair: Pair) -> None:
    events = pair.read([0, 1, 2], [13, 4, 9], notify=b"req-1:1")
    assert [type(e) for e in events] == [ReadCompleted]
    for region in range(REGIONS):
        for lb, rb in zip([0, 1, 2], [13, 4, 9], strict=True):
            assert bytes(pair.rmem[region, lb]) == bytes(pair.hmem[region, rb])
    assert not pair.rmem[:, 3:].any()  # nothing else was written
    pair.pump(lambda: bool(pair.received()))
    assert Received(peer=pair.rpeer, payload=b"req-1:1") in pair.holder_events
    assert pair.reader.stats.reads_completed == 1


def test_sliced_read_moves_only_its_part(pair: Pair) -> None:
    half = BLOCK_LEN // 2
    events = pair.read(
        [5],
        [6],
        local_slice=BlockSlice(index=1, parts=2),
        remote_slice=BlockSlice(index=0, parts=2),
    )
    assert isinstance(events[-1], ReadCompleted)
    for region in range(REGIONS):
        assert bytes(pair.rmem[region, 5, half:]) == bytes(pair.hmem[region, 6, :half])
        assert not pair.rmem[region, 5, :half].any()
    # Two slices, two cached remote descriptor lists; a repeat prepares nothing new.
    pair.read(
        [7],
        [6],
        remote_slice=BlockSlice(index=0, parts=2),
        local_slice=BlockSlice(index=0, parts=2),
    )
    assert pair.reader.stats.remote_dlists_prepared == 1


def test_zero_blocks_sends_only_the_notification(pair: Pair) -> None:
    rid = pair.reader.read_blocks(pair.hpeer, local_blocks=[], remote_blocks=[], notify=b"hit")
    pair.pump(lambda: bool(pair.received()))
    assert pair.reader_events == [ReadCompleted(read_id=rid)]
    assert pair.holder_events == [Received(peer=pair.rpeer, payload=b"hit")]
    assert not pair.rmem.any()


def test_bytes_are_exact_and_size_is_enforced_never_truncated(pair: Pair) -> None:
    payloads = [b"", b"\x00", b"\xff\xfe\x00binary", bytes(range(256)) * 4]
    for p in payloads:
        pair.reader.send(pair.hpeer, p)
    pair.pump(lambda: len(pair.received()) == len(payloads))
    assert sorted(pair.received()) == sorted(payloads)
    small = NixlTransport(name_prefix="s", max_notification_size=8, progress_thread=False)
    try:
        peer = small.add_peer(pair.holder.metadata())
        small.send(peer, b"12345678")
        with pytest.raises(FrameTooLarge):
            small.send(peer, b"123456789")
        assert small.stats.notifications_sent == 1
    finally:
        small.close()


def test_errors_are_typed(pair: Pair) -> None:
    with pytest.raises(UnknownPeer):
        pair.reader.send("nobody", b"x")
    with pytest.raises(BadMetadata):
        pair.reader.add_peer(b"\x00garbage")
    with pytest.raises(BadMetadata):
        pair.reader.add_peer(pair.reader.metadata())  # its own
    other = msgspec.msgpack.encode(
        {"kind": "ucx", "version": 1, "agent_name": "x", "agent_metadata": b"x", "layout": None}
    )
    with pytest.raises(BadMetadata):
        pair.reader.add_peer(other)
    with pytest.raises(MemoryNotRegistered):
        pair.reader.read_blocks(pair.hpeer, local_blocks=[0], remote_blocks=[BLOCKS])
    with pytest.raises(LayoutMismatch):
        pair.reader.read_blocks(pair.hpeer, local_blocks=[0, 1], remote_blocks=[0])
    with pytest.raises(LayoutMismatch):
        pair.reader.read_blocks(
            pair.hpeer,
            local_blocks=[0],
            remote_blocks=[0],
            remote_slice=BlockSlice(index=0, parts=2),
        )
    with pytest.raises(RegistrationError):
        pair.reader.register_blocks(_layout(pair.rmem))
    assert pair.reader.add_peer(pair.holder.metadata()) == pair.hpeer  # idempotent
    pair.reader.remove_peer(pair.hpeer)
    pair.reader.remove_peer(pair.hpeer)  # idempotent
    with pytest.raises(UnknownPeer):
        pair.reader.send(pair.hpeer, b"x")


def test_a_read_of_unregistered_remote_memory_is_an_error_not_a_hang(pair: Pair) -> None:
    meta, layout = nixl_wire.decode_metadata(pair.holder.metadata())
    assert layout is not None
    stray = np.zeros((REGIONS, BLOCKS, BLOCK_LEN), dtype=np.uint8)  # never registered
    forged = nixl_wire.encode_metadata(
        nixl_wire.EndpointMetadata(
            kind=meta.kind,
            version=meta.version,
            agent_name=meta.agent_name,
            agent_metadata=meta.agent_metadata,
            layout=nixl_wire.layout_to_wire(_layout(stray)),
        )
    )
    third = NixlTransport(name_prefix="t", progress_thread=False)
    try:
        mem = _memory(fill=None)  # kept alive while registered
        third.register_blocks(_layout(mem))
        peer = third.add_peer(forged)
        with pytest.raises(MemoryNotRegistered):
            third.read_blocks(peer, local_blocks=[0], remote_blocks=[0])
    finally:
        third.close()


def test_bare_agent_metadata_and_a_spoofed_envelope(pair: Pair) -> None:
    meta, layout = nixl_wire.decode_metadata(pair.holder.metadata())
    other = NixlTransport(name_prefix="o", progress_thread=False)
    try:
        # A stock peer: bare NIXL agent metadata plus its layout.
        peer = other.add_nixl_agent(meta.agent_metadata, layout)
        assert peer == pair.hpeer
        assert other.add_nixl_agent(meta.agent_metadata, layout) == peer  # idempotent
        mem = _memory(fill=None)  # kept alive while registered
        other.register_blocks(_layout(mem))
        # An envelope that names someone else but carries the known peer's blob is refused,
        # and the known peer keeps working.
        forged = nixl_wire.encode_metadata(
            nixl_wire.EndpointMetadata(
                kind=meta.kind,
                version=meta.version,
                agent_name="someone-else",
                agent_metadata=meta.agent_metadata,
                layout=meta.layout,
            )
        )
        with pytest.raises(BadMetadata):
            other.add_peer(forged)
        rid = other.read_blocks(peer, local_blocks=[1], remote_blocks=[2])
        sink: dict[str, list[TransportEvent]] = {}
        _pump([pair.holder, other], lambda: bool(sink.get(other.local_peer)), sink)
        assert sink[other.local_peer] == [ReadCompleted(read_id=rid)]
        assert bytes(mem[0, 1]) == bytes(pair.hmem[0, 2])
    finally:
        other.close()


def test_metadata_taken_before_registration_is_refreshed(pair: Pair) -> None:
    late = NixlTransport(name_prefix="late", progress_thread=False)
    try:
        early_md = late.metadata()
        peer = pair.reader.add_peer(early_md)
        with pytest.raises(MemoryNotRegistered):
            pair.reader.read_blocks(peer, local_blocks=[0], remote_blocks=[0])
        mem = _memory(fill=5)
        late.register_blocks(_layout(mem))
        assert late.metadata() != early_md
        assert pair.reader.add_peer(late.metadata()) == peer
        rid = pair.reader.read_blocks(peer, local_blocks=[2], remote_blocks=[3])
        pair.pump(lambda: bool(pair.reader_events), late)
        assert pair.reader_events == [ReadCompleted(read_id=rid)]
        assert bytes(pair.rmem[1, 2]) == bytes(mem[1, 3])
    finally:
        late.close()


def test_owner_thread_is_enforced(pair: Pair) -> None:
    caught: list[BaseException] = []

    def intruder() -> None:
        for call in (pair.reader.poll, pair.reader.metadata, pair.reader.close):
            try:
                call()
            except WrongThread as exc:
                caught.append(exc)
        assert pair.reader.local_peer  # read-only properties are fine anywhere

    t = threading.Thread(target=intruder)
    t.start()
    t.join()
    assert len(caught) == 3
    pair.reader.poll()  # still usable from its owner


def test_handover_to_another_thread() -> None:
    t = NixlTransport(name_prefix="x", progress_thread=False)
    out: list[object] = []

    def worker() -> None:
        t.adopt_current_thread()
        out.append(t.poll())
        t.close()

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert out == [[]]


def test_close_is_idempotent_and_final(pair: Pair) -> None:
    pair.reader.close()
    pair.reader.close()
    for call in (
        pair.reader.poll,
        pair.reader.metadata,
        lambda: pair.reader.send(pair.hpeer, b"x"),
    ):
        with pytest.raises(TransportClosed):
            call()


def test_probes_are_dropped_by_a_nixl_receiver_and_loss_is_reported_once(pair: Pair) -> None:
    assert pair.holder.probe_peers() == 1
    pair.pump(lambda: pair.reader.stats.probes_dropped == 1)
    assert pair.reader_events == []  # the probe is not reported
    # The reader goes away: the holder's next probe fails and reports the peer once.
    pair.reader.close()
    deadline = time.monotonic() + 2
    lost: list[PeerLost] = []
    while not lost and time.monotonic() < deadline:
        pair.holder.probe_peers()
        lost = [e for e in pair.holder.poll() if isinstance(e, PeerLost)]
        time.sleep(0.01)
    assert [e.peer for e in lost] == [pair.rpeer]
    assert pair.holder.probe_peers() == 0  # lost peers are not probed again
    assert PROBE_PAYLOAD not in pair.received()


def test_layout_from_tensors_split_and_joined() -> None:
    torch = pytest.importorskip("torch")
    from kvproto_transports.nixl import layout_from_tensors

    layers = [torch.zeros(2, 10, 16, 2, 8, dtype=torch.float16) for _ in range(3)]
    split = layout_from_tensors({f"l{i}": t for i, t in enumerate(layers)}, split_k_and_v=True)
    assert split.num_regions == 6 and split.num_blocks == 10
    assert split.block_lens == (16 * 2 * 8 * 2,) * 6
    assert split.region_addrs[1] == layers[0][1].data_ptr()
    assert split.memory_kind == "DRAM"
    joined = layout_from_tensors([torch.zeros(10, 2, 16, 8) for _ in range(2)], split_k_and_v=False)
    assert joined.num_regions == 2 and joined.block_lens == (2 * 16 * 8 * 4,) * 2
    from kvproto.errors import LocalProtocolError

    with pytest.raises(LocalProtocolError):
        layout_from_tensors([torch.zeros(2, 10, 4), torch.zeros(2, 11, 4)], split_k_and_v=True)
    with pytest.raises(LocalProtocolError):
        layout_from_tensors([torch.zeros(4, 10).t()], split_k_and_v=False)
