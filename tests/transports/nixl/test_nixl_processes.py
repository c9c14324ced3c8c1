"""Two (or three) real processes: ZMQ handshake, NIXL READs of torch tensors, notifications."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import zmq

from kvproto.tpmath import expected_consumers, read_slices, target_remote_ranks
from kvproto.transport import ReadCompleted, Received
from kvproto_binding.sidechannel import fetch_metadata
from kvproto_transports.nixl import NixlTransport, nixl_available
from tests.transports.nixl.node import NodeProcess

AVAILABLE, WHY = nixl_available()
pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not AVAILABLE, reason=f"NIXL: {WHY}")]

COMPAT = b"kvproto-test-compat"
LAYERS, BLOCKS = 2, 16
FULL = (4, 8)  # heads x head_dim floats per block (float32: 128 B per region block)
HALF = (2, 8)


def _nodes(nodes: Any) -> tuple[NodeProcess, NodeProcess]:
    return nodes  # type: ignore[no-any-return]


def _chunks(blob: bytes, parts: int) -> list[bytes]:
    n = len(blob) // parts
    return [blob[i * n : (i + 1) * n] for i in range(parts)]


def test_handshake_heartbeat_read_and_done_across_processes(nodes: Any) -> None:
    holder, reader = _nodes(nodes)
    holder.call("create", key="h1", progress_thread=False)
    reader.call("create", key="r1", progress_thread=False)
    holder.call("make_kv", key="h1", layers=LAYERS, num_blocks=BLOCKS, block_shape=FULL, fill=1)
    reader.call("make_kv", key="r1", layers=LAYERS, num_blocks=BLOCKS, block_shape=FULL, fill=None)
    port = holder.call("serve", compat_hash=COMPAT, ranks={0: "h1"})
    hs = reader.call("handshake", key="r1", port=port, rank=0, compat_hash=COMPAT)
    print(f"\nhandshake: min RTT {hs['rtt'] * 1e3:.2f} ms, offset {hs['offset'] * 1e6:.0f} us")
    (reader_id,) = holder.call("accept_introductions")  # the holder can reach the reader back

    # The reader heartbeats while its request is queued.
    reader.call("send", key="r1", peer=hs["peer"], payload=b"HB:req-1")
    assert holder.call("wait_events", key="h1", count=1) == [
        Received(peer=reader_id, payload=b"HB:req-1")
    ]
    holder.call("send", key="h1", peer=reader_id, payload=b"ack")
    assert reader.call("wait_events", key="r1", count=1) == [
        Received(peer=hs["peer"], payload=b"ack")
    ]

    # Partial prefix hit: the reader's blocks 4..6 take the holder's tail 9..11.
    rid = reader.call(
        "read",
        key="r1",
        peer=hs["peer"],
        local_blocks=[4, 5, 6],
        remote_blocks=[9, 10, 11],
        notify=b"req-1:1",
    )
    assert reader.call("wait_events", key="r1", count=1) == [ReadCompleted(read_id=rid)]
    assert holder.call("wait_events", key="h1", count=1) == [
        Received(peer=reader_id, payload=b"req-1:1")
    ]
    got = reader.call("blocks_bytes", key="r1", blocks=[4, 5, 6])
    want = holder.call("blocks_bytes", key="h1", blocks=[9, 10, 11])
    assert len(got) == LAYERS * 2 * 3 and got == want
    untouched = reader.call("blocks_bytes", key="r1", blocks=[0, 7, 15])
    assert all(not any(b) for b in untouched)
    stats = reader.call("stats", key="r1")
    assert stats.reads_started == 1 and stats.reads_completed == 1  # one READ for all regions

    # Full prefix hit: nothing to read, the notification alone.
    rid = reader.call(
        "read", key="r1", peer=hs["peer"], local_blocks=[], remote_blocks=[], notify=b"req-2:1"
    )
    assert reader.call("wait_events", key="r1", count=1) == [ReadCompleted(read_id=rid)]
    assert holder.call("wait_events", key="h1", count=1) == [
        Received(peer=reader_id, payload=b"req-2:1")
    ]
    assert holder.call("server_stats").replies_ok == 3
    for node, key in ((holder, "h1"), (reader, "r1")):
        node.call("close", key=key)


def test_holder_tp2_reader_tp1(nodes: Any) -> None:
    holder, reader = _nodes(nodes)
    holder_tp, reader_tp = 2, 1
    for rank in range(holder_tp):
        holder.call("create", key=f"hp{rank}", progress_thread=False)
        holder.call(
            "make_kv",
            key=f"hp{rank}",
            layers=LAYERS,
            num_blocks=BLOCKS,
            block_shape=HALF,
            fill=10 + rank,
        )
    port = holder.call("serve", compat_hash=COMPAT, ranks={r: f"hp{r}" for r in range(holder_tp)})
    reader.call("create", key="rq0", progress_thread=False)
    reader.call("make_kv", key="rq0", layers=LAYERS, num_blocks=BLOCKS, block_shape=FULL, fill=None)
    targets = target_remote_ranks(0, reader_tp, holder_tp)
    assert targets == [0, 1]
    for remote_rank in targets:
        peer = reader.call("handshake", key="rq0", port=port, rank=remote_rank, compat_hash=COMPAT)[
            "peer"
        ]
        local_slice, remote_slice = read_slices(0, reader_tp, holder_tp, remote_rank)
        reader.call(
            "read",
            key="rq0",
            peer=peer,
            local_blocks=[1, 2],
            remote_blocks=[3, 14],
            local_slice=(local_slice.index, local_slice.parts),
            remote_slice=(remote_slice.index, remote_slice.parts),
            notify=b"req:1",
        )
    done = reader.call("wait_events", key="rq0", count=2)
    assert all(isinstance(e, ReadCompleted) for e in done) and len(done) == 2
    got = reader.call("blocks_bytes", key="rq0", blocks=[1, 2])
    for remote_rank in targets:
        want = holder.call("blocks_bytes", key=f"hp{remote_rank}", blocks=[3, 14])
        assert [_chunks(g, holder_tp)[remote_rank] for g in got] == want
        # Each holder rank expects exactly this many done notifications.
        n = expected_consumers(holder_tp, reader_tp)
        assert len(holder.call("wait_events", key=f"hp{remote_rank}", count=n)) == n
    for r in range(holder_tp):
        holder.call("close", key=f"hp{r}")
    reader.call("close", key="rq0")


def test_holder_tp1_reader_tp2(nodes: Any) -> None:
    holder, reader = _nodes(nodes)
    holder_tp, reader_tp = 1, 2
    holder.call("create", key="hs", progress_thread=False)
    holder.call("make_kv", key="hs", layers=LAYERS, num_blocks=BLOCKS, block_shape=FULL, fill=20)
    port = holder.call("serve", compat_hash=COMPAT, ranks={0: "hs"})
    for rank in range(reader_tp):  # both reader ranks as agents of the reader process
        key = f"rs{rank}"
        reader.call("create", key=key, progress_thread=False)
        reader.call(
            "make_kv", key=key, layers=LAYERS, num_blocks=BLOCKS, block_shape=HALF, fill=None
        )
        (remote_rank,) = target_remote_ranks(rank, reader_tp, holder_tp)
        peer = reader.call("handshake", key=key, port=port, rank=remote_rank, compat_hash=COMPAT)[
            "peer"
        ]
        local_slice, remote_slice = read_slices(rank, reader_tp, holder_tp, remote_rank)
        reader.call(
            "read",
            key=key,
            peer=peer,
            local_blocks=[0, 7],
            remote_blocks=[5, 6],
            local_slice=(local_slice.index, local_slice.parts),
            remote_slice=(remote_slice.index, remote_slice.parts),
            notify=b"req:2",
        )
    want = holder.call("blocks_bytes", key="hs", blocks=[5, 6])
    for rank in range(reader_tp):
        assert isinstance(reader.call("wait_events", key=f"rs{rank}", count=1)[0], ReadCompleted)
        got = reader.call("blocks_bytes", key=f"rs{rank}", blocks=[0, 7])
        assert got == [_chunks(w, reader_tp)[rank] for w in want]
    n = expected_consumers(holder_tp, reader_tp)
    assert n == 2
    dones = holder.call("wait_events", key="hs", count=n)
    assert [e.payload for e in dones] == [b"req:2"] * n
    assert len({e.peer for e in dones}) == n  # from two distinct reader agents
    holder.call("close", key="hs")
    for rank in range(reader_tp):
        reader.call("close", key=f"rs{rank}")


def test_junk_from_a_third_process_is_counted_and_harmless(nodes: Any) -> None:
    holder, reader = _nodes(nodes)
    holder.call("create", key="hj", progress_thread=False)
    holder.call("make_kv", key="hj", layers=1, num_blocks=4, block_shape=FULL, fill=3)
    port = holder.call("serve", compat_hash=COMPAT, ranks={0: "hj"})

    # This test process is the third party. First, hostile side-channel frames.
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        junk = ctx.socket(zmq.DEALER)
        junk.setsockopt(zmq.LINGER, 0)
        junk.connect(f"tcp://127.0.0.1:{port}")
        for frames in ([b"", os.urandom(64)], [b""], [b"", b"\xc1"], [b"a", b"b", b"c", b"d"]):
            junk.send_multipart(frames)
        time.sleep(0.2)
        junk.close()
        # Then a valid handshake without an introduction, and junk notifications.
        reply = fetch_metadata(ctx, "127.0.0.1", port, 0, requester="mallory", compat_hash=COMPAT)
    finally:
        ctx.term()
    stats = holder.call("server_stats")
    assert stats.malformed >= 3 and stats.internal_errors == 0

    third = NixlTransport(name_prefix="mallory", progress_thread=False)
    try:
        peer = third.add_peer(reply.metadata)
        payloads = [os.urandom(n) for n in (0, 1, 7, 300, 4096)] + [b"HB:not-yours", b"x:999"]
        for p in payloads:
            third.send(peer, p)
        holder.submit("wait_events", key="hj", count=len(payloads))
        while not holder.ready():  # keep our side progressing (no progress thread)
            third.poll()
            time.sleep(0.001)
        got = holder.result()
    finally:
        third.close()
    assert sorted(e.payload for e in got) == sorted(payloads)  # byte-exact, attributed
    assert {e.peer for e in got} == {third.local_peer}
    hstats = holder.call("stats", key="hj")
    assert hstats.received_from_unknown == len(payloads)

    # The listener is alive and still serves a legitimate reader.
    reader.call("create", key="rj", progress_thread=False)
    reader.call("make_kv", key="rj", layers=1, num_blocks=4, block_shape=FULL, fill=None)
    hs = reader.call("handshake", key="rj", port=port, rank=0, compat_hash=COMPAT)
    reader.call("read", key="rj", peer=hs["peer"], local_blocks=[0], remote_blocks=[3])
    assert isinstance(reader.call("wait_events", key="rj", count=1)[0], ReadCompleted)
    assert reader.call("blocks_bytes", key="rj", blocks=[0]) == holder.call(
        "blocks_bytes", key="hj", blocks=[3]
    )
    holder.call("close", key="hj")
    reader.call("close", key="rj")
