"""MooncakeTransport in one process: typed errors for bad peer input, frames, registration."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvproto.tpmath import BlockLayout
from kvproto.transport import (
    BadMetadata,
    MemoryNotRegistered,
    PeerUnreachable,
    ReadCompleted,
    Received,
    RegistrationError,
    TransportClosed,
)
from kvproto_transports.conformance.hostmem import HostMemory
from kvproto_transports.mooncake import (
    DEFAULT_PROBE_INTERVAL_S,
    FAILURE_DETECTION_BOUND_S,
    MooncakeTransport,
)
from kvproto_transports.mooncake.transport import detection_bound_s
from kvproto_transports.mooncake.wire import WIRE_KIND, decode_frame, decode_metadata
from tests.transports.mooncake.mooncake_required import needs_mooncake, require_mooncake


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[MooncakeTransport, MooncakeTransport]]:
    require_mooncake()
    a, b = MooncakeTransport(name_prefix="a"), MooncakeTransport(name_prefix="b")
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _meta(**fields: object) -> bytes:
    base: dict[str, object] = {
        "kind": WIRE_KIND,
        "version": 1,
        "peer": "p-1",
        "incarnation": 1,
        "session": "127.0.0.1:15000",
        "notify_address": "tcp://127.0.0.1:15001",
        "layout": None,
    }
    base.update(fields)
    return msgspec.msgpack.encode(base)


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"\xff\x00garbage",
        msgspec.msgpack.encode({"kind": "kvproto-ucx", "version": 1}),
        _meta(version=2),
        _meta(peer=""),
        _meta(session="no-port"),
        _meta(session="127.0.0.1:99999"),
        _meta(notify_address="ipc:///tmp/x"),
        _meta(notify_address="tcp://127.0.0.1:x"),
        _meta(
            layout={
                "region_addrs": [1],
                "block_lens": [8],
                "num_blocks": 1,
                "device_id": 0,
                "memory_kind": "HBM",
            }
        ),
        _meta(
            layout={
                "region_addrs": [1, 2],
                "block_lens": [8],
                "num_blocks": 1,
                "device_id": 0,
                "memory_kind": "DRAM",
            }
        ),
    ],
)
def test_bad_metadata_is_a_typed_error(blob: bytes) -> None:
    with pytest.raises(BadMetadata):
        decode_metadata(blob)


def test_frames_not_for_us_or_malformed_are_dropped() -> None:
    me = b"me-1"
    assert decode_frame([me, b"you-2", b"\x00x"], me) == ("you-2", b"\x00x")
    assert decode_frame([b"other-1", b"you-2", b"x"], me) is None  # an older incarnation's
    assert decode_frame([me, b"you-2"], me) is None
    assert decode_frame([me, b"", b"x"], me) is None
    assert decode_frame([me, b"\xff\xfe", b"x"], me) is None
    assert decode_frame([me, b"y" * 300, b"x"], me) is None


@needs_mooncake
def test_garbage_on_the_notify_socket_is_counted_not_raised(
    pair: tuple[MooncakeTransport, MooncakeTransport],
) -> None:
    a, _b = pair
    address = msgspec.msgpack.decode(a.metadata())["notify_address"]
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(address)
    for parts in ([b"x"], [b"nobody", b"s", b"p"], [a.local_peer.encode(), b"\xff", b"p"]):
        push.send_multipart(parts)
    push.send_multipart([a.local_peer.encode(), b"stranger-1", b"ok"])
    got: list[object] = []
    for _ in range(2000):
        got += a.poll()
        if got:
            break
        zmq.select([], [], [], 0.001)
    push.close(linger=0)
    ctx.term()
    assert got == [Received(peer="stranger-1", payload=b"ok")]
    assert a.stats.frames_dropped == 3


@needs_mooncake
def test_reads_need_registered_memory_on_both_sides(
    pair: tuple[MooncakeTransport, MooncakeTransport],
) -> None:
    a, b = pair
    pb = a.add_peer(b.metadata())
    with pytest.raises(MemoryNotRegistered):
        a.read_blocks(pb, local_blocks=[0], remote_blocks=[0])
    rid = a.read_blocks(pb, local_blocks=[], remote_blocks=[])  # zero blocks: legal
    for _ in range(2000):
        events = a.poll()
        if events:
            break
        zmq.select([], [], [], 0.001)
    assert events == [ReadCompleted(read_id=rid)]


@needs_mooncake
def test_vram_is_refused_by_the_non_cuda_engine() -> None:
    mem = HostMemory()
    dram = mem.allocate(num_regions=1, block_len=64, num_blocks=2)
    vram = BlockLayout(
        region_addrs=dram.region_addrs,
        block_lens=dram.block_lens,
        num_blocks=2,
        memory_kind="VRAM",
    )
    with MooncakeTransport() as t:
        with pytest.raises(RegistrationError, match="CUDA"):
            t.register_blocks(vram)
        t.register_blocks(dram)
        with pytest.raises(RegistrationError):
            t.register_blocks(dram)
    with pytest.raises(TransportClosed):
        t.poll()


@needs_mooncake
def test_a_lost_peer_is_unreachable_until_added_again() -> None:
    a, b = MooncakeTransport(probe_interval_s=0.02), MooncakeTransport()
    try:
        meta = b.metadata()
        pb = a.add_peer(meta)
        b.close()
        # Until a deadline, not a count of polls: zmq.select on no sockets does not sleep
        # here, and 5,000 polls ended in 23 ms, before the second failed probe (~40 ms).
        deadline = time.monotonic() + 5.0
        while not a.poll() and time.monotonic() < deadline:
            time.sleep(0.001)
        with pytest.raises(PeerUnreachable):
            a.send(pb, b"x")
        with pytest.raises(PeerUnreachable):
            a.read_blocks(pb, local_blocks=[], remote_blocks=[])
        assert a.add_peer(meta) == pb  # re-armed: sends queue again, probes resume
        a.send(pb, b"x")
    finally:
        a.close()


def test_the_declared_detection_bound_grows_with_the_probe_interval() -> None:
    # Two missed probes make a peer lost: the second comes two intervals after the death.
    assert detection_bound_s(DEFAULT_PROBE_INTERVAL_S) == FAILURE_DETECTION_BOUND_S
    assert detection_bound_s(0.01) == FAILURE_DETECTION_BOUND_S
    assert detection_bound_s(0.25) == pytest.approx(1.3)  # the vLLM adapter's default
    assert detection_bound_s(1.0) == pytest.approx(2.8)


HIDE = """
import sys
sys.modules["mooncake"] = None
sys.modules["mooncake.engine"] = None
from kvproto_tools.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_conformance_without_mooncake_says_what_to_install() -> None:
    run = subprocess.run(
        [sys.executable, "-c", HIDE, "conformance", "--transport", "mooncake"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert "transport 'mooncake' cannot start" in lines[0]
    assert "pip install 'kvproto[mooncake]'" in lines[0]
