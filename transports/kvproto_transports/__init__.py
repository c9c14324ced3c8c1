"""Transports for kvproto: loopback, NIXL, UCX, Mooncake, and the conformance kit.

Each implements :class:`kvproto.Transport`. The names an embedder needs are
exported here and imported on first use, so that naming one transport never
loads another's native library:

- the in-process loopback: :class:`LoopbackNetwork` (the wire and its clock),
  :class:`LoopbackTransport` (one endpoint), :class:`LinkFaults`;
- :class:`NixlTransport`, :class:`UcxTransport`, :class:`MooncakeTransport` (each
  needs its library: ``pip install kvproto[nixl|ucx|mooncake]``);
- for a transport's author: :class:`TransportFactory`, :func:`run_conformance`
  and :class:`HostMemory` (spec/transport-authors.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .conformance import HostMemory, TransportFactory, run_conformance
    from .loopback import LinkFaults, LoopbackNetwork, LoopbackTransport
    from .mooncake import MooncakeTransport
    from .nixl import NixlTransport
    from .ucx import UcxTransport

_WHERE = {
    "LinkFaults": "loopback",
    "LoopbackNetwork": "loopback",
    "LoopbackTransport": "loopback",
    "NixlTransport": "nixl",
    "UcxTransport": "ucx",
    "MooncakeTransport": "mooncake",
    "HostMemory": "conformance",
    "TransportFactory": "conformance",
    "run_conformance": "conformance",
}

__all__ = [
    "HostMemory",
    "LinkFaults",
    "LoopbackNetwork",
    "LoopbackTransport",
    "MooncakeTransport",
    "NixlTransport",
    "TransportFactory",
    "UcxTransport",
    "run_conformance",
]


def __getattr__(name: str) -> Any:
    """Import the subpackage that defines ``name`` on first use."""
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{where}"), name)
