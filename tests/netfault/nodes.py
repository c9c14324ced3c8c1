"""Lease nodes (the NIXL and UCX transports under the real binding) in a namespace's process.

:class:`NsNodeProcess` is :class:`~tests.transports.nixl.node.NodeProcess`
with its child started inside a namespace; :class:`UcxLeaseNode` is the NIXL
tests' :class:`~tests.transports.nixl.lease_node.LeaseNode` with
:class:`~kvproto_transports.ucx.UcxTransport` endpoints instead of NIXL agents
(the same commands: ``create``, ``make_kv``, ``lease_holder``, ``grant``...).
"""

from __future__ import annotations

import multiprocessing
from typing import Any

from kvproto_tools.netns import spawn_in
from kvproto_transports.testing import serve
from tests.transports.nixl.lease_node import LeaseNode
from tests.transports.nixl.node import NodeProcess

NODE_CLS = {
    "nixl": "tests.netfault.nodes:NetLeaseNode",
    "ucx": "tests.netfault.nodes:UcxLeaseNode",
}
"""Node class run in the child, per transport."""


class NsNodeProcess(NodeProcess):
    """A :class:`NodeProcess` whose child runs in namespace ``netns`` with ``env`` set."""

    def __init__(self, name: str, *, netns: str, env: dict[str, str], node_cls: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = spawn_in(  # type: ignore[assignment]
            netns, serve, (child, ("torch",), node_cls), env=env, name=name
        )
        child.close()
        self._pending = False
        self._started = False


class NetLeaseNode(LeaseNode):
    """:class:`LeaseNode` (NIXL agents) plus a command to zero blocks between reads."""

    def zero_blocks(self, key: str, blocks: list[int]) -> None:
        """Zero ``blocks`` of every region (the next read must bring the bytes again)."""
        for t in self.tensors[key]:
            for b in blocks:
                t[:, b].zero_()

    def reader_debug(self, key: str) -> dict[str, Any]:
        """The reader core's counters and its sessions' states (for failure messages)."""
        import dataclasses

        reader = self.endpoints[key].reader
        assert reader is not None
        sessions = {
            f"{s.engine}/{s.rank}": {
                "state": s.state.name,
                "leases": len(s.beats.leases),
                "inflight": len(s.beats.inflight),
                "pending_claims": len(s.beats.pending_claims),
                "seq": s.beats.seq,
                "acked_seq": s.beats.acked_seq,
            }
            for s in reader._sessions.values()
        }
        return {"stats": dataclasses.asdict(reader.stats), "sessions": sessions}


class UcxLeaseNode(NetLeaseNode):
    """:class:`NetLeaseNode` over UcxTransport endpoints."""

    def create(self, key: str, **kwargs: Any) -> str:
        from kvproto_transports.ucx import UcxTransport

        kwargs.pop("progress_thread", None)  # a NIXL option
        t = UcxTransport(name_prefix=key, **kwargs)
        self.transports[key] = t  # type: ignore[assignment]
        self.events[key] = []
        return str(t.local_peer)
