"""vLLM general plugin: make ``KvprotoConnector`` known to vLLM's connector factory by name.

Declared as the ``vllm.general_plugins`` entry point ``kvproto_vllm`` (pyproject.toml), which
vLLM loads in every process it starts (front end, engine core, workers) unless ``VLLM_PLUGINS``
names other plugins only. Registration is lazy (a module path and a class name): nothing of the
adapter is imported until vLLM asks for the class.

Why: ``MultiConnector.build_kv_connector_stats`` rebuilds each child's serialized stats with
``KVConnectorFactory.get_connector_class_by_name``, in whichever process logs them; an
out-of-tree connector loaded only through ``kv_connector_module_path`` is not in that registry.
Importing :mod:`kvproto_vllm.connector` registers it too, for installs without the entry point.
"""

from __future__ import annotations

import contextlib

CONNECTOR_NAME = "KvprotoConnector"
CONNECTOR_MODULE = "kvproto_vllm.connector"


def register() -> None:
    """Register the connector class name with vLLM's factory (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # ValueError: already registered (the plugin and the connector module both call this).
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
