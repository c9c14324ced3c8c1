"""The NIXL transport: real NIXL agents, registered KV memory, one-sided READs.

Import is cheap: NIXL itself is loaded when the first :class:`NixlTransport`
is created (see :mod:`._library`). :func:`nixl_available` says whether it can be.
"""

from __future__ import annotations

from ..tensor_layout import layout_from_tensors, memory_kind_of
from ._library import nixl_available
from .errors import LayoutMismatch, RegistrationError, WrongThread
from .transport import (
    DEFAULT_MAX_NOTIFICATION_SIZE,
    DEFAULT_PROGRESS_WAIT_US,
    PROBE_PAYLOAD,
    NixlStats,
    NixlTransport,
)

__all__ = [
    "DEFAULT_MAX_NOTIFICATION_SIZE",
    "DEFAULT_PROGRESS_WAIT_US",
    "PROBE_PAYLOAD",
    "LayoutMismatch",
    "NixlStats",
    "NixlTransport",
    "RegistrationError",
    "WrongThread",
    "layout_from_tensors",
    "memory_kind_of",
    "nixl_available",
]
