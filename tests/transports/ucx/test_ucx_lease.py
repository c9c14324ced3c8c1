"""The lease protocol end to end over real UCX: heartbeats renew, one read, done frees.

Two UcxTransport endpoints in this process (real UCX over TCP, one-sided gets),
the real holder and reader cores, and the shared binding. Wall-clock time, a
6 s lease (heartbeat 1 s, extension 4 s) so that "queued past the lease" takes
seconds, not minutes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvproto.config import LeaseConfig
from kvproto.events import ReadGo, ReleaseReason
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto_binding.step import Binding
from kvproto_transports.conformance.hostmem import HostMemory
from kvproto_transports.ucx import UcxTransport, ucx_available, unavailable_reason

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not ucx_available(), reason=f"UCX: {unavailable_reason()}"),
]

REGIONS, BLOCK, BLOCKS = 2, 4096, 16


@pytest.fixture
def world() -> Iterator[tuple[Binding, Binding, HostMemory, HostMemory]]:
    p_tr, d_tr = UcxTransport(name_prefix="holder"), UcxTransport(name_prefix="reader")
    p_mem, d_mem = HostMemory(), HostMemory()
    try:
        for tr, mem in ((p_tr, p_mem), (d_tr, d_mem)):
            tr.register_blocks(
                mem.allocate(num_regions=REGIONS, block_len=BLOCK, num_blocks=BLOCKS)
            )
        cfg = LeaseConfig(kv_lease_duration=6, read_margin=1.0, ack_timeout=2.0)
        p = Binding(p_tr, holder=Holder(cfg, engine="P", incarnation=1))
        d = Binding(d_tr, reader=Reader(cfg, engine="D", incarnation=2))
        p_tr.add_peer(d_tr.metadata())  # the side channel's introduction
        yield p, d, p_mem, d_mem
    finally:
        p_tr.close()
        d_tr.close()


def _run(p: Binding, d: Binding, seconds: float, results: dict[str, list[object]]) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        now = time.monotonic()
        results["freed"] += p.step(now).freed
        step = d.step(now)
        for connect in step.connects:
            d.connected(
                now, engine=connect.engine, rank=connect.rank, metadata=p.transport.metadata()
            )
        results["confirmed"] += step.confirmed
        results["failed"] += step.failed
        time.sleep(0.005)


def test_queued_past_the_lease_then_one_read_and_done_frees(
    world: tuple[Binding, Binding, HostMemory, HostMemory],
) -> None:
    p, d, p_mem, d_mem = world
    assert p.holder is not None and d.reader is not None
    p_layout = p.transport.layout  # type: ignore[attr-defined]
    assert p_layout is not None
    for region in range(REGIONS):
        for block in range(BLOCKS):
            p_mem.write_block(p_layout, region, block, bytes([region * 32 + block]) * BLOCK)
    results: dict[str, list[object]] = {"freed": [], "confirmed": [], "failed": []}
    ticket = p.holder.grant(time.monotonic(), request_id="p-1")
    d.reader.track(time.monotonic(), request_id="d-1", ticket=ticket)
    _run(p, d, 8.0, results)  # queued 8 s: past the 6 s lease, kept by heartbeats
    assert results == {"freed": [], "confirmed": [], "failed": []}
    assert p.holder.stats.heartbeats >= 6
    go = d.start_read(
        time.monotonic(), "d-1", local_blocks=[0, 1, 2, 3], remote_blocks=[9, 10, 11, 12]
    )
    assert isinstance(go, ReadGo)
    _run(p, d, 1.0, results)
    assert [f.reason for f in results["freed"]] == [ReleaseReason.DONE]  # type: ignore[attr-defined]
    assert results["confirmed"] == ["d-1"] and results["failed"] == []
    d_layout = d.transport.layout  # type: ignore[attr-defined]
    for region in range(REGIONS):
        for local, remote in zip([0, 1, 2, 3], [9, 10, 11, 12], strict=True):
            assert (
                d_mem.read_block(d_layout, region, local) == bytes([region * 32 + remote]) * BLOCK
            )
