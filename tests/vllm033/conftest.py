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

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything here needs vLLM: mark it so `-m "not vllm"` works."""
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama + BPE tokenizer on disk (built once per session)."""
    pytest.importorskip("transformers", reason="transformers comes with vllm")
    from tests.vllm.tiny_model import build_tiny_llama

    model_dir: Path = build_tiny_llama(tmp_path_factory.mktemp("tinyllama"))
    return model_dir
