"""kv_transfer_config dicts for the kvproto connector (shared by the vLLM tests)."""

from __future__ import annotations

from typing import Any

MODULE_PATH = "kvproto_vllm.connector"
CLASS_NAME = "KvprotoConnector"


def kvproto_config(role: str, **extra: Any) -> dict[str, Any]:
    """What an operator passes as --kv-transfer-config (policy recompute, as documented)."""
    return {
        "kv_connector": CLASS_NAME,
        "kv_connector_module_path": MODULE_PATH,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra),
    }


def stock_config(role: str, **extra: Any) -> dict[str, Any]:
    """Stock NixlConnector, same policy, for side-by-side figures."""
    return {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra),
    }


def events(state: dict[str, Any], kind: str) -> list[tuple[float, str, str, str]]:
    """The worker connector's recorded events of one kind."""
    out: list[tuple[float, str, str, str]] = []
    for t, k, subject, detail in state["worker"]["events"]:
        if k == kind:
            out.append((t, k, subject, detail))
    return out
