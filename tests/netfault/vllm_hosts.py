"""Real vLLM CPU engines on the namespace hosts of a :class:`~tests.netfault.netns.Link`.

Each engine's child process enters its host's namespace before anything loads: UCX (NIXL's
backend) runs over TCP on the veth only, and the side channel binds the host's veth address
(``VLLM_NIXL_SIDE_CHANNEL_HOST``), so every byte between the engines crosses the faulty link.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

from kvproto_tools.netns import spawn_in, transport_env
from tests.vllm.engine_proc import EngineProc, EngineSpec, _child_main, free_port
from tests.vllm.kvproto_config import kvproto_config

from .netns import Link


class NsEngine(EngineProc):
    """An :class:`EngineProc` whose child runs in a namespace (UCX on its veth only)."""

    def __init__(self, spec: EngineSpec, *, name: str, netns: str, env: dict[str, str]) -> None:
        self.name = name
        self.spec = spec
        self._conn, child = mp.get_context("spawn").Pipe()
        self.proc = spawn_in(netns, _child_main, (child, spec), env=env, name=name)  # type: ignore[assignment]
        child.close()
        self.info: dict[str, Any] | None = None


def ns_engine(
    model: Path,
    link: Link,
    host: str,
    role: str,
    *,
    lease_s: float,
    connector_extra: dict[str, Any] | None = None,
    **spec: Any,
) -> NsEngine:
    """A KvprotoConnector engine of ``role`` on ``host`` (prefix caching off)."""
    env = {**transport_env(link.ifname[host]), "VLLM_NIXL_SIDE_CHANNEL_HOST": link.addr[host]}
    engine_spec = EngineSpec(
        model=str(model),
        kv_transfer_config=kvproto_config(
            role, kv_lease_duration=lease_s, **(connector_extra or {})
        ),
        side_channel_port=free_port(),
        prefix_caching=False,
        extra_env=env,
        **spec,
    )
    return NsEngine(engine_spec, name=role, netns=host, env=env)
