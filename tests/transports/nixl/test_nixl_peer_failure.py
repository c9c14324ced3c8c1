"""kill -9 of a peer process: what NIXL reports, and how fast."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest

from kvproto.transport import PeerLost, ReadCompleted, ReadFailed, Received
from kvproto_transports.nixl import nixl_available
from tests.transports.nixl.node import NodeError, NodeProcess

AVAILABLE, WHY = nixl_available()
pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not AVAILABLE, reason=f"NIXL: {WHY}")]

COMPAT = b"kvproto-test-compat"
SHAPE = (4, 8)


def test_kill_9_is_reported_as_peer_lost_both_ways(nodes: Any) -> None:
    holder, reader = nodes
    assert isinstance(holder, NodeProcess) and isinstance(reader, NodeProcess)
    victim = NodeProcess("victim")
    try:
        victim.wait_started()
        # The victim is a reader of `holder` (two agents: one watched by plain
        # sends, one by the auto-probe) and a holder for `reader`.
        holder.call("create", key="hk_send", progress_thread=False)
        holder.call("create", key="hk_probe", progress_thread=False, auto_probe_interval_s=0.05)
        for key in ("hk_send", "hk_probe"):
            holder.call("make_kv", key=key, layers=1, num_blocks=4, block_shape=SHAPE, fill=1)
        hport = holder.call("serve", compat_hash=COMPAT, ranks={0: "hk_send", 1: "hk_probe"})
        victim.call("create", key="vh", progress_thread=False)
        victim.call("make_kv", key="vh", layers=2, num_blocks=64, block_shape=(64, 64), fill=7)
        vport = victim.call("serve", compat_hash=COMPAT, ranks={0: "vh"})
        holder_peers = []
        for rank, key in ((0, "v_send"), (1, "v_probe")):
            victim.call("create", key=key, progress_thread=False)
            victim.call("make_kv", key=key, layers=1, num_blocks=4, block_shape=SHAPE, fill=None)
            hs = victim.call("handshake", key=key, port=hport, rank=rank, compat_hash=COMPAT)
            holder_peers.append(hs["peer"])
            victim.call("heartbeat", key=key, peer=hs["peer"], payload=b"HB", interval_s=0.02)
        v_send, v_probe = holder.call("accept_introductions")
        for key in ("hk_send", "hk_probe"):  # heartbeats arrive while the victim lives
            assert holder.call("wait_events", key=key, count=1) == [
                Received(peer=v_send if key == "hk_send" else v_probe, payload=b"HB")
            ]
        reader.call("create", key="rk", progress_thread=False)
        reader.call("make_kv", key="rk", layers=2, num_blocks=64, block_shape=(64, 64), fill=None)
        vpeer = reader.call("handshake", key="rk", port=vport, rank=0, compat_hash=COMPAT)["peer"]
        reader.call("read", key="rk", peer=vpeer, local_blocks=[0], remote_blocks=[1])
        assert isinstance(reader.call("wait_events", key="rk", count=1)[0], ReadCompleted)

        killed_at = time.monotonic()
        victim.kill()

        # The holder side: one endpoint sends every 10 ms, the other only polls.
        send_loss, probe_loss = holder.call(
            "detect_losses",
            watch=[("hk_send", v_send, True), ("hk_probe", v_probe, False)],
            every_s=0.01,
        )
        read_error = _read_from_dead_holder(reader, vpeer)
        to_send = send_loss["lost_at"] - killed_at
        after_send = send_loss["lost_at"] - send_loss["failed_send_at"]
        to_probe = probe_loss["lost_at"] - killed_at
        print(
            f"\nkill -9 -> PeerLost: {to_send * 1e3:.1f} ms with a send every 10 ms "
            f"({send_loss['sends']:.0f} sends still succeeded; PeerLost {after_send * 1e3:.2f} ms "
            f"after the failed send); {to_probe * 1e3:.1f} ms with auto-probe every 50 ms; "
            f"reader of the dead holder: {read_error}"
        )
        assert to_send <= 1.0
        assert to_probe <= 1.0
        assert probe_loss["failed_send_at"] == -1.0  # found by the probe, not by the binding
        assert holder.call("stats", key="hk_probe").probes_sent >= 1
    finally:
        victim.kill()
        victim.close()
        for node, key in ((holder, "hk_send"), (holder, "hk_probe"), (reader, "rk")):
            with contextlib.suppress(NodeError):
                node.call("close", key=key)


def _read_from_dead_holder(reader: NodeProcess, vpeer: str) -> str:
    """A read of the dead holder's memory ends in error, never in done."""
    try:
        rid = reader.call(
            "read",
            key="rk",
            peer=vpeer,
            local_blocks=list(range(64)),
            remote_blocks=list(range(64)),
            notify=b"late",
        )
    except NodeError as exc:  # the loss was already known: refused at once
        assert exc.kind == "PeerUnreachable"
        return "PeerUnreachable"
    events = reader.call("wait_events", key="rk", count=2, kinds=("ReadFailed", "PeerLost"))
    assert [e.read_id for e in events if isinstance(e, ReadFailed)] == [rid]
    assert [e.peer for e in events if isinstance(e, PeerLost)] == [vpeer]
    return "ReadFailed + PeerLost"
