"""Lazy import of ucxx, so that importing this package never needs UCX."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from .errors import UcxUnavailable


@functools.cache
def _try_import() -> tuple[Any, str]:
    try:
        # ucxx first: it sets UCX env defaults and loads libucp before libucxx.
        importlib.import_module("ucxx")
        libucxx = importlib.import_module("ucxx._lib.libucxx")
        array = importlib.import_module("ucxx._lib.arr").Array
    except Exception as exc:  # ImportError, or a broken native library (OSError)
        return None, f"cannot import ucxx ({type(exc).__name__}: {exc}); pip install ucxx-cu12"
    return (libucxx, array), ""


def ucx_available() -> bool:
    """Whether ucxx imports here (its C++ library and libucp load)."""
    return _try_import()[0] is not None


def unavailable_reason() -> str:
    """Why :func:`ucx_available` is False ("" when it is True)."""
    return _try_import()[1]


def load_ucxx() -> tuple[Any, Any]:
    """``(ucxx._lib.libucxx, ucxx._lib.arr.Array)``, or :class:`UcxUnavailable`."""
    mods, reason = _try_import()
    if mods is None:
        raise UcxUnavailable(reason)
    api, array = mods
    return api, array
