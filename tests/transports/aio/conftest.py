"""Event loops for the asyncio driver tests: a virtual-clock loop beside the default one.

A test picks one with ``@pytest.mark.asyncio(loop_factories=["virtual"])`` (or
``["default"]``); this hook only applies to the tests in this directory.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Mapping
from typing import Any

import pytest


class _JumpSelector(selectors.DefaultSelector):
    """Real I/O is checked without waiting; a wait for a timer jumps the clock instead."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = 0.0

    def select(self, timeout: float | None = None) -> list[Any]:
        ready: list[Any] = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # nothing scheduled: only real I/O can wake the loop
            return list(super().select(None))
        self.clock += timeout
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """``time()`` is virtual, starts at 0.0 (like the loopback network) and jumps to timers."""

    def __init__(self) -> None:
        self._jump = _JumpSelector()
        super().__init__(self._jump)

    def time(self) -> float:
        return self._jump.clock


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"virtual": VirtualClockLoop, "default": asyncio.new_event_loop}
