"""A holder process in namespace P and a reader process in namespace D, running lease cores."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvproto.config import LeaseConfig
from kvproto_tools.netns import transport_env

from .netns import Link
from .nodes import NODE_CLS, NsNodeProcess

CONFIG: dict[str, Any] = {"kv_lease_duration": 6.0, "read_margin": 1.0, "ack_timeout": 2.0}
"""Short leases so each fault takes seconds: heartbeat interval 1 s, extension 4 s."""
LAYERS, BLOCKS, SHAPE = 2, 16, (4, 8)
READ_LOCAL, READ_REMOTE = [0, 1, 2], [7, 8, 9]


def until(cond: Callable[[], bool], timeout_s: float, every_s: float = 0.02) -> float:
    """Wait (bounded) until ``cond()``; returns when it held (monotonic). Raises on timeout."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(every_s)
    return time.monotonic()


@dataclass
class World:
    """Holder engine ``P`` in the link's P namespace, reader engine ``D`` in its D namespace."""

    link: Link
    transport: str
    holder: NsNodeProcess
    reader: NsNodeProcess
    cfg: LeaseConfig = field(default_factory=lambda: LeaseConfig(**CONFIG))
    granted: dict[str, str] = field(default_factory=dict)
    """Reader request id -> holder request id."""
    granted_at: dict[str, float] = field(default_factory=dict)
    """Reader request id -> when P's grant returned (monotonic, an upper bound)."""

    @classmethod
    def start(cls, link: Link, transport: str, **create: Any) -> World:
        """Spawn both nodes, make the endpoints and KV memory, and the lease cores."""
        env_p = transport_env(link.ifname[link.p])
        env_d = transport_env(link.ifname[link.d])
        holder = NsNodeProcess("P", netns=link.p, env=env_p, node_cls=NODE_CLS[transport])
        reader = NsNodeProcess("D", netns=link.d, env=env_d, node_cls=NODE_CLS[transport])
        world = cls(link=link, transport=transport, holder=holder, reader=reader)
        try:
            holder.wait_started()
            reader.wait_started()
            holder.call("create", key="P", progress_thread=False, **create)
            reader.call("create", key="D", progress_thread=False, **create)
            kv: dict[str, Any] = {"layers": LAYERS, "num_blocks": BLOCKS, "block_shape": SHAPE}
            holder.call("make_kv", key="P", fill=5, **kv)
            reader.call("make_kv", key="D", fill=None, **kv)
            port = holder.call(
                "lease_holder", key="P", engine="P", config=CONFIG, host=link.addr[link.p]
            )
            reader.call(
                "lease_reader",
                key="D",
                engine="D",
                config=CONFIG,
                holder_ports={"P": port},
                holder_hosts={"P": link.addr[link.p]},
            )
        except BaseException:
            world.close()
            raise
        return world

    def close(self) -> None:
        """Stop both nodes (killed if they do not exit)."""
        self.holder.close()
        self.reader.close()

    # -- requests ---------------------------------------------------------------

    def request(self, rid: str) -> None:
        """P grants a lease for ``rid``; D tracks it (it starts heartbeating)."""
        ticket = self.holder.call("grant", key="P", request_id=f"p-{rid}")
        self.reader.call("track", key="D", request_id=rid, ticket=ticket)
        self.granted[rid] = f"p-{rid}"
        self.granted_at[rid] = time.monotonic()

    def ready(self, rid: str) -> bool:
        return bool(self.reader.call("ready_to_read", key="D", request_id=rid))

    def attempt(self, rid: str) -> str:
        """Try to read ``rid`` now: the decision's class name, or ``failed:<reason>``."""
        failed = self.failed()
        if rid in failed:
            return f"failed:{failed[rid]}"
        return self.start_read(rid)

    def start_read(self, rid: str) -> str:
        """D starts the read of ``rid`` (one READ, done attached); the decision's class name."""
        return str(
            self.reader.call(
                "start_read",
                key="D",
                request_id=rid,
                local_blocks=READ_LOCAL,
                remote_blocks=READ_REMOTE,
            )
        )

    def serve(self, rid: str, timeout_s: float) -> str:
        """Read ``rid`` when ready, retrying a deferral; returns the final decision (bounded)."""
        deadline = time.monotonic() + timeout_s
        decision = "not-ready"
        while time.monotonic() < deadline:
            if rid in self.failed() or not self.ready(rid):
                if rid in self.failed():
                    return "failed"
                time.sleep(0.02)
                continue
            decision = self.start_read(rid)
            if decision != "ReadDeferred":
                return decision
            time.sleep(0.05)
        return decision

    # -- what each side saw -------------------------------------------------------

    def freed(self) -> dict[str, tuple[float, str]]:
        """Holder request id -> (when, reason) of each freed lease."""
        return {
            r: (float(t), str(w)) for t, r, w in self.holder.call("lease_log", key="P")["freed"]
        }

    def confirmed(self) -> dict[str, float]:
        return {r: float(t) for t, r in self.reader.call("lease_log", key="D")["confirmed"]}

    def failed(self) -> dict[str, str]:
        return {r: str(w) for _t, r, w in self.reader.call("lease_log", key="D")["failed"]}

    def debug(self) -> str:
        """Both sides' state, for a failure message."""
        return (
            f"confirmed {self.confirmed()}, failed {self.failed()}, freed {self.freed()}, "
            f"holder {self.holder_log()['holder_stats']}, "
            f"reader {self.reader.call('reader_debug', key='D')}"
        )

    def holder_log(self) -> dict[str, Any]:
        log: dict[str, Any] = self.holder.call("lease_log", key="P")
        return log

    def bytes_match(self) -> bool:
        """D's read blocks hold exactly P's bytes."""
        got = self.reader.call("blocks_bytes", key="D", blocks=READ_LOCAL)
        return bool(got == self.holder.call("blocks_bytes", key="P", blocks=READ_REMOTE))

    def clear_read_blocks(self) -> None:
        """Zero D's destination blocks (so the next confirmed read proves its own bytes)."""
        self.reader.call("zero_blocks", key="D", blocks=READ_LOCAL)
