"""Forgery over real NIXL: a third agent that claims the decoder's agent name.

NIXL delivers a notification from an agent never added under the name its sender
claims, so a third process ``X`` creates a NIXL agent with D's exact agent name and
floods the holder with every frame a forger can make: heartbeats without proof (``count=0,
digest=0``) at ``seq=2**62``, unsigned and signed with a guessed key, dones and aborts
carrying D's claim proof (as an on-path observer would have sniffed it), and a Hello
without an anchor as a "new incarnation" of D. In the default configuration none of
it changes the lease, and D, heartbeating all along, is never starved: its read is
confirmed at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from kvproto import wire
from kvproto.config import LeaseConfig
from kvproto.ticket import LeaseTicket, claim_proof
from kvproto_transports.nixl import nixl_available

AVAILABLE, WHY = nixl_available()
pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not AVAILABLE, reason=f"NIXL: {WHY}")]

FORGER_NODE = "tests.transports.nixl.forger_node:ForgerNode"
DURATION = 6.0  # heartbeat interval 1 s, extension 4 s
CONFIG: dict[str, Any] = {"kv_lease_duration": DURATION, "read_margin": 2.0}
SHAPE = (4, 8)


def _until(cond: Callable[[], bool], timeout_s: float, every_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(every_s)


def _forged_frames(ticket: LeaseTicket) -> list[bytes]:
    sniffed = wire.Claim(lease=ticket.lease, proof=claim_proof(ticket.token, "DF", ticket.lease))
    guessed = b"g" * 16
    empty = wire.Heartbeat(seq=2**62, claims=[], aborts=[], count=0, digest=0)
    abort = wire.Heartbeat(seq=2**62 + 1, claims=[], aborts=[sniffed], count=0, digest=0)
    resync = wire.Heartbeat(seq=2**62 + 2, claims=[], aborts=[], count=0, digest=0, full=[])
    done = wire.Done(claim=sniffed)
    hello = wire.Hello(engine="DF", rank=0, tp_size=1, incarnation=12345, nonce=bytes(16))
    frames = [wire.encode(hello)]
    for msg in (empty, abort, resync, done):
        frames += [wire.encode(msg), wire.encode(msg, guessed)]
    return frames


def test_a_third_agent_with_the_decoders_name_changes_nothing(nodes: Any) -> None:
    from tests.transports.nixl.node import NodeProcess

    holder, reader = nodes
    cfg = LeaseConfig(**CONFIG)
    forger = NodeProcess("forger", node_cls=FORGER_NODE, preload=())
    try:
        holder.call("create", key="PF", progress_thread=False)
        holder.call("make_kv", key="PF", layers=2, num_blocks=16, block_shape=SHAPE, fill=5)
        port = holder.call("lease_holder", key="PF", engine="PF", config=CONFIG)
        d_name = reader.call("create", key="DF", progress_thread=False)
        reader.call("make_kv", key="DF", layers=2, num_blocks=16, block_shape=SHAPE, fill=None)
        reader.call("lease_reader", key="DF", engine="DF", config=CONFIG, holder_ports={"PF": port})
        params = holder.call("grant", key="PF", request_id="p-f")
        ticket = LeaseTicket.from_params(params)
        reader.call("track", key="DF", request_id="d-f", ticket=params)
        _until(lambda: bool(reader.call("ready_to_read", key="DF", request_id="d-f")), 10.0)
        before = holder.call("lease_log", key="PF")["holder_stats"]

        forger.wait_started()
        p_name = forger.call(
            "forger", key="X", agent_name=d_name, target_metadata=holder.call("metadata", key="PF")
        )
        assert p_name != d_name
        frames = _forged_frames(ticket)
        # 9 frames every 2 ms for 8 s (up to 4500 frames/s, over the holder's 2000/s
        # per-peer limit): longer than the lease and its extension, so the lease lives
        # only if every genuine heartbeat still counts.
        rounds = int((DURATION + 2.0) / 0.002)
        sent = forger.call(
            "forge", key="X", payloads=frames, rounds=rounds, every_s=0.002, timeout_s=60.0
        )
        log = holder.call("lease_log", key="PF")
        stats = log["holder_stats"]
        print(
            f"\nNIXL forger as {d_name}: {sent} frames sent; holder counted "
            f"bad_mac={stats['bad_mac'] - before['bad_mac']}, "
            f"bad_hello={stats['bad_hello'] - before['bad_hello']}, "
            f"rate_limited={stats['rate_limited'] - before['rate_limited']}; "
            f"genuine heartbeats applied meanwhile: {stats['heartbeats'] - before['heartbeats']}"
        )
        assert sent > 0
        assert stats["rate_limited"] - before["rate_limited"] > 0  # more than the budget
        assert stats["bad_mac"] - before["bad_mac"] > 0  # the forgeries arrived as D
        assert stats["bad_hello"] - before["bad_hello"] > 0
        for applied in ("claims", "done_frames", "aborted", "released_done", "peer_lost"):
            assert stats[applied] == before[applied], applied
        assert log["freed"] == [] and log["live_leases"] == 1
        # D heartbeats once a second: 8 s of flood, every tick applied (one of slack).
        assert (
            stats["heartbeats"] - before["heartbeats"]
            >= (DURATION + 2.0) / cfg.heartbeat_interval - 1
        )
        assert reader.call("lease_log", key="DF")["failed"] == []

        go = reader.call(
            "start_read", key="DF", request_id="d-f", local_blocks=[0, 1], remote_blocks=[3, 4]
        )
        assert go == "ReadGo"
        _until(lambda: bool(reader.call("lease_log", key="DF")["confirmed"]), 5.0)
        assert [f[1:] for f in holder.call("lease_log", key="PF")["freed"]] == [("p-f", "DONE")]
        assert reader.call("blocks_bytes", key="DF", blocks=[0, 1]) == holder.call(
            "blocks_bytes", key="PF", blocks=[3, 4]
        )
    finally:
        forger.kill()
        forger.close()
