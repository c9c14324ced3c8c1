"""Fixtures for the vLLM 0.33 tests (contract and scheduler level; no engine, no device).

vLLM 0.33.0 exists only as a CUDA build; on a CPU-only machine it imports and
``current_platform`` is ``UnspecifiedPlatform``, so engines cannot start and
``EngineArgs.create_engine_config`` fails (it asks the platform for a device
type). A ``VllmConfig`` assembled from its parts with ``DeviceConfig("cpu")``
builds, and real 0.33 ``Scheduler``/``Request`` objects run on it
(:func:`.device_free.device_free_config`). Every module starts with ``require_vllm033()``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.fixtures import mark_vllm_under, tiny_model_dir

__all__ = ["tiny_model_dir"]  # the shared session fixture, collected from here

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything here needs vLLM."""
    mark_vllm_under(HERE, items)
