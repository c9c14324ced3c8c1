"""The UCX transport: ucxx endpoints, active-message notifications, UCP RMA reads.

Import is cheap: ucxx is loaded when the first :class:`UcxTransport` starts.
:func:`ucx_available` says whether it can be (``pip install ucxx-cu12``).
See ``spec/ucx-transport.md`` for what was measured and why it is built so.
"""

from __future__ import annotations

from ._ucxx import ucx_available, unavailable_reason
from .engine import DEFAULT_UCX_OPTIONS
from .errors import Backpressure, LayoutMismatch, RegistrationError, UcxUnavailable
from .shared import UcxStats
from .transport import (
    DEFAULT_MAX_NOTIFICATION_SIZE,
    DEFAULT_PROBE_INTERVAL_S,
    FAILURE_DETECTION_BOUND_S,
    UcxTransport,
)

__all__ = [
    "DEFAULT_MAX_NOTIFICATION_SIZE",
    "DEFAULT_PROBE_INTERVAL_S",
    "DEFAULT_UCX_OPTIONS",
    "FAILURE_DETECTION_BOUND_S",
    "Backpressure",
    "LayoutMismatch",
    "RegistrationError",
    "UcxStats",
    "UcxTransport",
    "UcxUnavailable",
    "ucx_available",
    "unavailable_reason",
]
