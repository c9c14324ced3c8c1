"""Run a test module only where vLLM 0.33 is the installed vLLM; skip it with a reason elsewhere.

With ``KVPROTO_REQUIRE_VLLM033=1`` (CI sets it in its vLLM 0.33 environment) a
missing, broken or other-version vLLM is an error, never a silent skip.
Telling the environments apart is the one place a version string is read:
the adapter itself uses feature checks.
"""

from __future__ import annotations

import os
from types import ModuleType

import pytest

INSTALL_HINT = (
    "vLLM 0.33 tests need vllm==0.33.0 in the running interpreter. .ci/run lays its files "
    "(no dependencies; the CUDA stack is never loaded here) over the main venv: "
    "pip install --no-deps --target .vllm033 vllm==0.33.0; "
    "PYTHONPATH=.vllm033 KVPROTO_REQUIRE_VLLM033=1 pytest tests/vllm033"
)
REQUIRE_ENV = "KVPROTO_REQUIRE_VLLM033"


def require_vllm033() -> ModuleType:
    """The vllm module, if it is 0.33.x; otherwise skip (or fail, if required)."""
    required = os.environ.get(REQUIRE_ENV) == "1"
    try:
        import vllm
    except ImportError as exc:
        if required:
            raise
        pytest.skip(f"vllm not importable ({exc}). {INSTALL_HINT}", allow_module_level=True)
    version = str(vllm.__version__)
    if not version.startswith("0.33."):
        why = f"these tests are for vLLM 0.33; the installed vLLM is {version}"
        if required:
            raise RuntimeError(f"{REQUIRE_ENV}=1 but {why}")
        pytest.skip(f"{why}. {INSTALL_HINT}", allow_module_level=True)
    return vllm
