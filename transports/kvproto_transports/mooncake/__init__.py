"""The Mooncake transport: Mooncake transfer-engine reads, ZMQ notifications.

Import is cheap: ``mooncake.engine`` is loaded when the first
:class:`MooncakeTransport` starts. :func:`mooncake_available` says whether it
can be (``pip install 'kvproto[mooncake]'``). See ``spec/mooncake-transport.md``
for what was measured and why it is built so.
"""

from __future__ import annotations

from ._engine import INSTALL_HINT, mooncake_available, unavailable_reason
from .errors import Backpressure, MooncakeUnavailable
from .stats import MooncakeStats
from .transport import (
    DEFAULT_MAX_NOTIFICATION_SIZE,
    DEFAULT_PROBE_INTERVAL_S,
    FAILURE_DETECTION_BOUND_S,
    MooncakeTransport,
)

__all__ = [
    "DEFAULT_MAX_NOTIFICATION_SIZE",
    "DEFAULT_PROBE_INTERVAL_S",
    "FAILURE_DETECTION_BOUND_S",
    "INSTALL_HINT",
    "Backpressure",
    "MooncakeStats",
    "MooncakeTransport",
    "MooncakeUnavailable",
    "mooncake_available",
    "unavailable_reason",
]
