"""KvprotoConnector against every public member of the installed vLLM's base class.

A vLLM upgrade that adds a hook or abstract method to ``KVConnectorBase_V1``
fails here until the hook is read and listed in connector_hooks.py (implemented,
or inherited with a reason). Runs on whichever vLLM is installed (0.32 in the
main environment; tests/vllm033 runs the same check on 0.33).
"""

from __future__ import annotations

from .vllm_required import require_vllm

require_vllm()

from .connector_hooks import IMPLEMENTED, INHERITED, public_members  # noqa: E402


def test_every_base_member_is_accounted_for() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvproto_vllm.connector import KvprotoConnector

    assert not IMPLEMENTED & set(INHERITED), "a member is listed as both"
    base = public_members(KVConnectorBase_V1)
    unknown = base - IMPLEMENTED - set(INHERITED)
    assert not unknown, f"vLLM's KVConnectorBase_V1 has members nobody reviewed: {sorted(unknown)}"
    # Every abstract method is ours (not left to the base).
    assert KVConnectorBase_V1.__abstractmethods__ <= IMPLEMENTED
    # What we claim to implement is in our class body (a base member or our own hook).
    for name in IMPLEMENTED & base:
        assert name in vars(KvprotoConnector), f"{name} is listed as implemented but inherited"
    for name in set(INHERITED) & base:
        assert name not in vars(KvprotoConnector), f"{name} is listed as inherited but overridden"
