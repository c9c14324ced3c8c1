"""The ``vllm-step`` suite's timed connectors resolve through vLLM's own factory (no engine).

What the suite relies on before any engine starts: vLLM's
``KVConnectorFactory`` finds both classes by ``kv_connector_module_path``,
each is the real connector underneath (so vLLM's checks and hooks see it as
such), and every hook vLLM calls in a step is timed.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm.vllm_required import require_vllm

require_vllm()

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import nixl  # noqa: E402

from kvproto_tools.bench import step_connectors  # noqa: E402
from kvproto_vllm.connector import KvprotoConnector  # noqa: E402

pytestmark = pytest.mark.vllm  # imports vLLM (no engine): `-m "not vllm"` leaves it out

MODULE = "kvproto_tools.bench.step_connectors"
PER_STEP = (
    "build_connector_meta",
    "update_connector_output",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "request_finished",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_transfer_results",
    "get_kv_connector_stats",
    "clear_connector_metadata",
)
"""Hooks vLLM 0.32's scheduler, model runner and attention layers call every step."""


@pytest.mark.parametrize(
    ("name", "real"),
    [("KvprotoConnector", KvprotoConnector), ("NixlConnector", nixl.NixlConnector)],
)
def test_factory_loads_the_timed_subclass_of_the_real_connector(name: str, real: Any) -> None:
    config = KVTransferConfig(
        kv_connector=name, kv_connector_module_path=MODULE, kv_role="kv_producer"
    )
    cls = KVConnectorFactory.get_connector_class(config)
    assert cls is getattr(step_connectors, name)  # built once, the same class each time
    assert cls.__name__ == name and issubclass(cls, real) and cls is not real
    for hook in PER_STEP:
        assert hook in vars(cls), f"{name}.{hook} is not timed"
        assert getattr(cls, hook).__wrapped__ is getattr(real, hook)


def test_an_unknown_class_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchConnector"):
        _ = step_connectors.NoSuchConnector
