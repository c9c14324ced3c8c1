"""A child-process node that also runs the lease cores over its NixlTransports.

Each lease endpoint is the real binding (:class:`kvproto_binding.step.Binding`)
stepped with ``time.monotonic()`` every tick of the node loop. A holder engine
gets its own side-channel server and adds every reader that introduces itself;
a reader engine answers the core's ``Connect`` with a non-blocking
:class:`~kvproto_binding.sidechannel.HandshakeClient`. Used by the NIXL
end-to-end lease tests (``NodeProcess(node_cls="tests.transports.nixl.lease_node:LeaseNode")``).
"""

from __future__ import annotations

import time
from typing import Any, cast

from kvproto.config import LeaseConfig
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto.ticket import LeaseTicket
from kvproto_binding.sidechannel import (
    HandshakeClient,
    HandshakeSucceeded,
    SideChannelServer,
)
from kvproto_binding.step import Binding
from tests.transports.nixl.node import Node

COMPAT = b"kvproto-lease-e2e"


class LeaseNode(Node):
    """:class:`~tests.transports.nixl.node.Node` plus lease cores driven by the binding."""

    def __init__(self) -> None:
        super().__init__()
        self.endpoints: dict[str, Binding] = {}
        self.servers: dict[str, SideChannelServer] = {}
        self.clients: dict[str, HandshakeClient] = {}
        self.holder_ports: dict[str, int] = {}
        self.holder_hosts: dict[str, str] = {}
        self.freed: dict[str, list[tuple[float, str, str]]] = {}
        self.confirmed: dict[str, list[tuple[float, str]]] = {}
        self.failed: dict[str, list[tuple[float, str, str]]] = {}

    def lease_holder(
        self, key: str, *, engine: str, config: dict[str, Any], host: str = "127.0.0.1"
    ) -> int:
        """Run a holder core (``LeaseConfig(**config)``) on ``key``; returns its side-channel port.

        Its side-channel server (bound to ``host``) serves rank 0 and collects introductions.
        """
        holder = Holder(LeaseConfig(**config), engine=engine, incarnation=1)
        self.endpoints[key] = Binding(self.transports[key], holder=holder)
        self.bound.add(key)
        self.freed[key] = []
        server = SideChannelServer(host=host, base_port=0, compat_hash=COMPAT)
        server.set_metadata(0, self.transports[key].metadata())
        self.servers[key] = server
        return int(server.port)

    def lease_reader(
        self,
        key: str,
        *,
        engine: str,
        config: dict[str, Any],
        holder_ports: dict[str, int],
        holder_hosts: dict[str, str] | None = None,
    ) -> None:
        """Run a reader core on ``key``; holders are found by engine in ``holder_ports``.

        ``holder_hosts`` names a holder's side-channel address (default 127.0.0.1).
        """
        reader = Reader(LeaseConfig(**config), engine=engine, incarnation=1)
        self.endpoints[key] = Binding(self.transports[key], reader=reader)
        self.bound.add(key)
        self.holder_ports.update(holder_ports)
        self.holder_hosts.update(holder_hosts or {})
        self.confirmed[key] = []
        self.failed[key] = []
        self.clients[key] = HandshakeClient(
            requester=engine,
            compat_hash=COMPAT,
            requester_metadata=self.transports[key].metadata(),
            timeout_s=1.0,
        )

    def grant(self, key: str, request_id: str) -> dict[str, Any]:
        holder = self.endpoints[key].holder
        assert holder is not None
        return holder.grant(time.monotonic(), request_id=request_id).to_params()

    def track(self, key: str, request_id: str, ticket: dict[str, Any]) -> None:
        reader = self.endpoints[key].reader
        assert reader is not None
        reader.track(
            time.monotonic(), request_id=request_id, ticket=LeaseTicket.from_params(ticket)
        )

    def ready_to_read(self, key: str, request_id: str) -> bool:
        self.pump()
        reader = self.endpoints[key].reader
        assert reader is not None
        return reader.ready_to_read(request_id)

    def start_read(
        self, key: str, request_id: str, local_blocks: list[int], remote_blocks: list[int]
    ) -> str:
        decision = self.endpoints[key].start_read(
            time.monotonic(), request_id, local_blocks=local_blocks, remote_blocks=remote_blocks
        )
        return type(decision).__name__

    def lease_log(self, key: str) -> dict[str, Any]:
        """What the engine saw: freed leases (holder), confirmed and failed requests (reader)."""
        self.pump()
        ep = self.endpoints[key]
        out: dict[str, Any] = {
            "freed": list(self.freed.get(key, [])),
            "confirmed": list(self.confirmed.get(key, [])),
            "failed": list(self.failed.get(key, [])),
        }
        if ep.holder is not None:
            out["holder_stats"] = ep.holder.stats_snapshot()
            out["live_leases"] = ep.holder.live_leases()
        return out

    def pump(self) -> None:
        super().pump()
        now = time.monotonic()
        for key, server in self.servers.items():
            for intro in server.poll_introductions():
                self.transports[key].add_peer(intro.metadata)
        for key, ep in self.endpoints.items():
            client = self.clients.get(key)
            if client is not None:
                for res in client.poll_results():
                    engine, rank = cast(tuple[str, int], res.peer_key)
                    if isinstance(res, HandshakeSucceeded):
                        ep.connected(now, engine=engine, rank=rank, metadata=res.reply.metadata)
                    else:
                        ep.connect_failed(now, engine=engine, rank=rank)
            result = ep.step(now)
            for free in result.freed:
                self.freed[key].append((now, free.request_id, free.reason.name))
            for rid in result.confirmed:
                self.confirmed[key].append((now, rid))
            for failed in result.failed:
                self.failed[key].append((now, failed.request_id, failed.reason.name))
            for connect in result.connects:
                assert client is not None
                port = self.holder_ports[connect.engine]
                host = self.holder_hosts.get(connect.engine, "127.0.0.1")
                client.submit((connect.engine, connect.rank), host, port, connect.rank)
