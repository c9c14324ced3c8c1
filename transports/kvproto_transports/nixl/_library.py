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
import threading
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
    bindings: Any
    """The ``_bindings`` module ``agent_cls`` builds its ``nixlAgentConfig`` from."""


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
            bindings=bindings,
        )
        return _loaded["api"]
    raise ImportError(f"NIXL is not importable ({'; '.join(reasons)})")


def nixl_available() -> tuple[bool, str]:
    """(True, module) if NIXL imports here, else (False, why): for skips and CLI checks."""
    try:
        return True, load_nixl().module
    except ImportError as exc:
        return False, str(exc)


_config_swap = threading.Lock()


def make_agent(api: NixlApi, name: str, config: Any, *, progress_wait_us: int) -> Any:
    """``api.agent_cls(name, config)`` with the progress thread's wait set to ``progress_wait_us``.

    NIXL's UCX progress thread sleeps in ``poll`` on its workers' event file
    descriptors, at most ``pthrDelay`` (rounded up to whole milliseconds: a
    periodic wake-up, NIXL's workaround for a UCX event it can miss) before it
    passes over them again; an arriving message wakes it at once. NIXL's Python
    API fixes ``pthrDelay`` at 0, so ``poll`` never sleeps and the thread spins a
    core (0.99 CPU-s per s idle here, against 0.005 with 10 ms). The C++ config
    has the field; the Python one does not pass it, so the config class the
    agent constructor builds is swapped, for this construction only, for one
    that keeps ``progress_wait_us`` whatever the constructor writes.
    """
    base = api.bindings.nixlAgentConfig
    wait = int(progress_wait_us)

    class _Config(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:
            return int(base.pthrDelay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, _value: int) -> None:
            base.pthrDelay.__set__(self, wait)

    with _config_swap:
        api.bindings.nixlAgentConfig = _Config
        try:
            return api.agent_cls(name, config)
        finally:
            api.bindings.nixlAgentConfig = base
