"""A lease node that can also run a raw NIXL agent under a name it chooses.

The third party: NIXL delivers a notification from an agent that was never
added under the name the sender claims (spec/nixl-transport.md §1), so an agent
created with the decoder's own agent name speaks, to the holder, as the decoder.
``NixlTransport`` always adds a random suffix to its name, so the forger uses the
NIXL agent API directly.
"""

from __future__ import annotations

import time
from typing import Any

from kvproto_transports.nixl._library import load_nixl
from kvproto_transports.nixl.wire import decode_metadata
from tests.transports.nixl.lease_node import LeaseNode


class ForgerNode(LeaseNode):
    """:class:`LeaseNode` plus raw agents that claim another agent's name."""

    def __init__(self) -> None:
        super().__init__()
        self.forgers: dict[str, tuple[Any, str]] = {}

    def forger(self, key: str, *, agent_name: str, target_metadata: bytes) -> str:
        """A NIXL agent named ``agent_name`` that knows the target; returns the target's name."""
        api = load_nixl()
        agent = api.agent_cls(
            agent_name, api.config_cls(enable_prog_thread=False, backends=["UCX"])
        )
        meta, _ = decode_metadata(target_metadata)
        loaded = agent.add_remote_agent(meta.agent_metadata)
        target = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self.forgers[key] = (agent, target)
        return target

    def forge(self, key: str, *, payloads: list[bytes], rounds: int, every_s: float) -> int:
        """Send every payload ``rounds`` times, a round every ``every_s``; sends that worked."""
        agent, target = self.forgers[key]
        sent = 0
        for _ in range(rounds):
            start = time.monotonic()
            for payload in payloads:
                try:
                    agent.send_notif(target, payload)
                    sent += 1
                except Exception:  # a refused send is not the point here
                    pass
            agent.get_new_notifs()  # drain answers, progress the worker
            time.sleep(max(0.0, every_s - (time.monotonic() - start)))
        return sent
