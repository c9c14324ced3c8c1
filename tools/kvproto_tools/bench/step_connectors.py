"""Timed connectors for ``--suite vllm-step``, loaded by vLLM via ``kv_connector_module_path``.

``{"kv_connector": "KvprotoConnector", "kv_connector_module_path":
"kvproto_tools.bench.step_connectors", ...}`` gives kvproto's connector,
``"NixlConnector"`` the stock one, each with its hooks timed
(:mod:`.step_timing`). The stock class keeps its name so that vLLM's
``has_connector("NixlConnector")`` checks see it exactly as they see stock.

Classes are built when vLLM first asks for them (module ``__getattr__``), so
loading one connector never imports the other's transport.
"""

from __future__ import annotations

import functools
import importlib

from kvproto_tools.bench.step_timing import timed_connector_class

BASES = {
    "KvprotoConnector": ("kvproto_vllm.connector", "KvprotoConnector"),
    "NixlConnector": ("vllm.distributed.kv_transfer.kv_connector.v1.nixl", "NixlConnector"),
}
"""Class name here -> (module, class) of the connector it times."""


@functools.cache
def _build(name: str) -> type:
    module, cls = BASES[name]
    base: type = getattr(importlib.import_module(module), cls)
    return timed_connector_class(base, name)


def __getattr__(name: str) -> type:
    if name not in BASES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _build(name)
