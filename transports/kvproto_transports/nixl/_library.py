"""Finding the NIXL Python API without paying for an unneeded torch import.

``pip install nixl`` is a meta-package whose ``nixl/__init__.py`` picks the
backend wheel (``nixl_cu13``, ``nixl_cu12``, ``nixl_rocm``) by the CUDA major
version. On a machine with a CPU-only torch it finds no CUDA version and ends
by *importing torch* (about 3 s here), which every process that only sends
notifications would pay. So we try the backend wheels directly first, unless
torch is already imported (then the meta-package's choice is free and right).
``KVPROTO_NIXL_MODULE`` names the module to use (``nixl._api``,
``nixl_cu12._api``...) where several backend wheels are installed at once.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any

_DIRECT = ("nixl_cu13._api", "nixl_cu12._api", "nixl_rocm._api")
_META = "nixl._api"


@dataclass(frozen=True, slots=True, kw_only=True)
class NixlApi:
    """The few NIXL objects the transport uses, from whichever wheel provided them."""

    module: str
    """Dotted name of the ``_api`` module that was imported."""
    agent_cls: Any
    """``nixl_agent``."""
    config_cls: Any
    """``nixl_agent_config``."""
    disconnect_error: type[BaseException]
    """``nixlRemoteDisconnectError``: the peer's process or endpoint is gone."""
    error_types: tuple[type[BaseException], ...]
    """Every ``nixl*Error`` class of the bindings (they derive from Exception only)."""


_loaded: dict[str, NixlApi] = {}  # one entry once NIXL was imported


def _candidates() -> list[str]:
    forced = os.environ.get("KVPROTO_NIXL_MODULE")
    if forced:
        return [forced]
    if "torch" in sys.modules:
        return [_META, *_DIRECT]
    return [*_DIRECT, _META]


def load_nixl() -> NixlApi:
    """Import NIXL once; raise ImportError with every attempt's reason if it is missing."""
    if "api" in _loaded:
        return _loaded["api"]
    reasons: list[str] = []
    for name in _candidates():
        try:
            api = importlib.import_module(name)
            bindings = importlib.import_module(name.rsplit(".", 1)[0] + "._bindings")
        except ImportError as exc:  # the wheel is absent or cannot load its libraries
            reasons.append(f"{name}: {exc}")
            continue
        errors = tuple(
            getattr(bindings, attr)
            for attr in dir(bindings)
            if attr.startswith("nixl") and attr.endswith("Error")
        )
        _loaded["api"] = NixlApi(
            module=name,
            agent_cls=api.nixl_agent,
            config_cls=api.nixl_agent_config,
            disconnect_error=bindings.nixlRemoteDisconnectError,
            error_types=errors,
        )
        return _loaded["api"]
    raise ImportError(f"NIXL is not importable ({'; '.join(reasons)})")


def nixl_available() -> tuple[bool, str]:
    """(True, module) if NIXL imports here, else (False, why): for skips and CLI checks."""
    try:
        return True, load_nixl().module
    except ImportError as exc:
        return False, str(exc)
