"""Lazy import of Mooncake's transfer engine, so that importing this package never needs it.

``mooncake.engine`` is a pybind11 module (``pip install
mooncake-transfer-engine-non-cuda``; its ``engine.so`` also links
``libibverbs.so.1``, Debian's ``libibverbs1``). Its log level is set to errors
before the first import (``MC_LOG_LEVEL=ERROR``) unless the environment already
names one: at the default level the engine logs a line per completed batch. (``GLOG_minloglevel``
has no effect on this build.)
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

from .errors import MooncakeUnavailable

INSTALL_HINT = "pip install 'kvproto[mooncake]'"
"""What to run when the engine is missing (the extra pins the wheel)."""

LIBS_HINT = (
    "the wheel's engine.so links libibverbs.so.1 (Debian: libibverbs1, with libnl-3-200 and "
    "libnl-route-3-200), which is not on the library path"
)
"""What to say when the wheel is there but a library its engine links is not."""

BAD_BATCH_IDS = frozenset({0, (1 << 64) - 1})
"""What ``batch_transfer_async_read`` returns when it could not submit: 0 (submit
refused, or the segment could not be opened) or ``(uint64)-1``."""


@functools.cache
def _try_import() -> tuple[Any, str]:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        engine = importlib.import_module("mooncake.engine")
    except Exception as exc:  # ImportError, or a native library that does not load (OSError)
        text = " ".join(str(exc).split())
        # The wheel installed but engine.so cannot find a system library: installing the
        # extra again would not help.
        hint = LIBS_HINT if "cannot open shared object file" in text else INSTALL_HINT
        return None, f"cannot import mooncake.engine ({type(exc).__name__}: {text}); {hint}"
    return engine, ""


def mooncake_available() -> bool:
    """Whether ``mooncake.engine`` imports here."""
    return _try_import()[0] is not None


def unavailable_reason() -> str:
    """Why :func:`mooncake_available` is False ("" when it is True)."""
    return _try_import()[1]


def load_engine() -> Any:
    """The ``mooncake.engine`` module, or :class:`MooncakeUnavailable` naming the extra."""
    module, reason = _try_import()
    if module is None:
        raise MooncakeUnavailable(reason)
    return module


def new_engine(host: str) -> Any:
    """A started ``TransferEngine`` over TCP with the P2P handshake (no metadata server).

    Its session name, ``f"{host}:{engine.get_rpc_port()}"``, is what peers read from.
    """
    module = load_engine()
    engine = module.TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise MooncakeUnavailable(f"TransferEngine.initialize({host!r}, P2PHANDSHAKE, tcp) = {rc}")
    return engine
