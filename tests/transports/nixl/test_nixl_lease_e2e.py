"""End to end: the lease cores and the binding over NixlTransport, in three processes.

P (holder process) runs two holder engines: P1 with the transport's auto-probe
(so a dead reader surfaces as PeerLost), P2 without (so it only lapses). D
(reader process) queues a request for longer than the lease, heartbeating,
then reads with one READ; the done notification frees the lease. A third
process V reads from both holders and is killed with SIGKILL while
heartbeating: P1 frees its lease on PeerLost, P2 when the lease lapses.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from kvproto.config import LeaseConfig
from kvproto_transports.nixl import nixl_available
from tests.transports.nixl.node import NodeProcess

AVAILABLE, WHY = nixl_available()
pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not AVAILABLE, reason=f"NIXL: {WHY}")]

LEASE_NODE = "tests.transports.nixl.lease_node:LeaseNode"
DURATION = 6.0  # the shortest valid lease: heartbeat interval 1 s, extension 4 s
CONFIG: dict[str, Any] = {"kv_lease_duration": DURATION, "read_margin": 2.0}
PROBE_S = 0.2
SHAPE = (4, 8)


def _until(cond: Callable[[], bool], timeout_s: float, every_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(every_s)


def _freed(node: NodeProcess, key: str) -> list[tuple[float, str, str]]:
    return [(float(t), str(r), str(w)) for t, r, w in node.call("lease_log", key=key)["freed"]]


def test_grant_heartbeat_read_done_and_kill_9_over_nixl(nodes: Any) -> None:
    holder, reader = nodes
    cfg = LeaseConfig(**CONFIG)
    victim = NodeProcess("lease-victim", node_cls=LEASE_NODE)
    try:
        holder.call("create", key="P1", progress_thread=False, auto_probe_interval_s=PROBE_S)
        holder.call("create", key="P2", progress_thread=False)
        holder.call("make_kv", key="P1", layers=2, num_blocks=16, block_shape=SHAPE, fill=4)
        ports = {
            engine: holder.call("lease_holder", key=engine, engine=engine, config=CONFIG)
            for engine in ("P1", "P2")
        }
        reader.call("create", key="D", progress_thread=False)
        reader.call("make_kv", key="D", layers=2, num_blocks=16, block_shape=SHAPE, fill=None)
        reader.call("lease_reader", key="D", engine="D", config=CONFIG, holder_ports=ports)
        victim.wait_started()
        for key in ("V1", "V2"):
            victim.call("create", key=key, progress_thread=False)
            victim.call("lease_reader", key=key, engine=key, config=CONFIG, holder_ports=ports)

        granted = time.monotonic()
        reader.call(
            "track",
            key="D",
            request_id="d-1",
            ticket=holder.call("grant", key="P1", request_id="p-d"),
        )
        victim.call(
            "track",
            key="V1",
            request_id="v-1",
            ticket=holder.call("grant", key="P1", request_id="p-v1"),
        )
        victim.call(
            "track",
            key="V2",
            request_id="v-2",
            ticket=holder.call("grant", key="P2", request_id="p-v2"),
        )

        # Queued past the lease duration: only the heartbeats keep the blocks.
        time.sleep(max(0.0, granted + DURATION + 1.5 - time.monotonic()))
        assert _freed(holder, "P1") == [] and _freed(holder, "P2") == []
        p1 = holder.call("lease_log", key="P1")
        # Two sessions (D and V1), each heartbeating once a second for over 7 s.
        assert p1["live_leases"] == 2 and p1["holder_stats"]["heartbeats"] >= 8
        assert reader.call("ready_to_read", key="D", request_id="d-1")

        # One READ of every region, done attached: the holder frees on it.
        assert (
            reader.call(
                "start_read",
                key="D",
                request_id="d-1",
                local_blocks=[0, 1, 2],
                remote_blocks=[7, 8, 9],
            )
            == "ReadGo"
        )
        _until(lambda: any(f[1] == "p-d" for f in _freed(holder, "P1")), 5.0)
        _until(lambda: bool(reader.call("lease_log", key="D")["confirmed"]), 5.0)
        assert [f[1:] for f in _freed(holder, "P1")] == [("p-d", "DONE")]
        assert reader.call("blocks_bytes", key="D", blocks=[0, 1, 2]) == holder.call(
            "blocks_bytes", key="P1", blocks=[7, 8, 9]
        )
        assert reader.call("lease_log", key="D")["failed"] == []

        # kill -9 the reader process V while it heartbeats both holders.
        killed = time.monotonic()
        victim.kill()

        def both_freed() -> bool:
            return any(f[1] == "p-v1" for f in _freed(holder, "P1")) and any(
                f[1] == "p-v2" for f in _freed(holder, "P2")
            )

        _until(both_freed, cfg.lease_extension + cfg.heartbeat_interval + 3.0, every_s=0.05)
        (lost,) = [f for f in _freed(holder, "P1") if f[1] == "p-v1"]
        (lapsed,) = [f for f in _freed(holder, "P2") if f[1] == "p-v2"]
        lost_after, lapsed_after = lost[0] - killed, lapsed[0] - killed
        print(
            f"\nkill -9 of a heartbeating reader: freed on PeerLost after "
            f"{lost_after * 1e3:.0f} ms "
            f"(auto-probe every {PROBE_S * 1e3:.0f} ms); freed on lapse after {lapsed_after:.2f} s "
            f"(extension {cfg.lease_extension:.0f} s, heartbeat interval "
            f"{cfg.heartbeat_interval:.0f} s)"
        )
        assert lost[2] == "PEER_LOST" and lost_after <= 1.0
        assert lapsed[2] == "EXPIRED"
        # Last heartbeat at most one interval before the kill, plus a tick of slack.
        assert lapsed_after <= cfg.lease_extension + cfg.heartbeat_interval + 0.5
    finally:
        victim.kill()
        victim.close()
