"""What tests/vllm and tests/vllm033 share: the vLLM marker and the tiny model on disk."""

from __future__ import annotations

from pathlib import Path

import pytest


def mark_vllm_under(folder: Path, items: list[pytest.Item]) -> None:
    """Mark every collected test under ``folder`` as needing vLLM (so `-m "not vllm"` works)."""
    for item in items:
        if folder in item.path.resolve().parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama + BPE tokenizer on disk (built once per session)."""
    pytest.importorskip("transformers", reason="transformers comes with vllm")
    from tests.vllm.tiny_model import build_tiny_llama

    model_dir: Path = build_tiny_llama(tmp_path_factory.mktemp("tinyllama"))
    return model_dir
