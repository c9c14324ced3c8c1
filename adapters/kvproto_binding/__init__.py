"""Bindings: the small loops that run the sans-I/O cores against a clock and a transport.

- :class:`Binding` (:mod:`kvproto_binding.step`): one engine rank's synchronous step
  (poll the transport, feed the cores, run their timers, carry out their outputs); the
  caller owns the clock and calls :meth:`Binding.step` with ``now``;
- :class:`AsyncBinding` (:mod:`kvproto_binding.aio`): an asyncio driver around a binding;
- :mod:`kvproto_binding.sidechannel`: the ZMQ side channel that introduces engines and hands
  over transport metadata before the first frame.

The cores never import from here; transports (``kvproto_transports``) know nothing of it either.
examples/embed/ runs an :class:`Binding` pair over the loopback transport and over a
transport of one's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .step import NOTHING, Binding, BindingStats, StepResult

if TYPE_CHECKING:
    from .aio import AsyncBinding, DriverClosed, DriverStats, Happened

__all__ = [
    "NOTHING",
    "AsyncBinding",
    "Binding",
    "BindingStats",
    "DriverClosed",
    "DriverStats",
    "Happened",
    "StepResult",
]

_AIO = frozenset({"AsyncBinding", "DriverClosed", "DriverStats", "Happened"})


def __getattr__(name: str) -> Any:
    """The asyncio driver's names, imported on first use (asyncio is not needed otherwise)."""
    if name in _AIO:
        from . import aio

        return getattr(aio, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
