"""The measurement loop the NIXL and UCX overhead benchmarks share.

Each transport's ``bench.measure_overhead`` builds its raw floor and its
transport pair and names four steps (``notif_rtt_raw``,
``notif_rtt_transport``, ``read_raw``, ``read_transport``), each a callable
that does one iteration and returns its seconds. This module runs them the
same way for both (warm-up, then interleaved iterations, so machine noise
hits raw and transport alike) and shapes the result the bench table prints:
``config``, then per step median/p10/p90/mean in microseconds, then the
``transport / raw`` ratios of the medians.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kvproto.tpmath import BlockLayout

WARMUP = 5
"""Untimed runs of each step first: connections, first-use descriptor lists and protocols."""


def host_layout(mem: np.ndarray, regions: int, num_blocks: int, block_len: int) -> BlockLayout:
    """The layout of ``mem`` (contiguous ``regions x num_blocks x block_len`` bytes)."""
    base = mem.ctypes.data
    return BlockLayout(
        region_addrs=tuple(base + r * num_blocks * block_len for r in range(regions)),
        block_lens=(block_len,) * regions,
        num_blocks=num_blocks,
    )


def partial_hit(blocks: int, num_blocks: int) -> tuple[list[int], list[int]]:
    """``(local, remote)`` blocks of the benches' read: the holder's last ``blocks`` blocks
    into the reader's first (a partial prefix hit: the two sides' block ids differ)."""
    return list(range(blocks)), list(range(num_blocks - blocks, num_blocks))


def read_config(*, iterations: int, blocks: int, regions: int, block_len: int) -> dict[str, Any]:
    """The ``config`` keys both benches report; each adds its transport's own after them."""
    return {
        "iterations": iterations,
        "blocks": blocks,
        "regions": regions,
        "block_len": block_len,
        "read_bytes": blocks * regions * block_len,
    }


def spin(cond: Callable[[], bool], timeout_s: float, what: str, pause_s: float = 0.0) -> None:
    """Call ``cond`` until it is true (sleeping ``pause_s`` between calls if given).

    Raises :class:`TimeoutError` naming ``what`` after ``timeout_s``.
    """
    deadline = time.perf_counter() + timeout_s
    while not cond():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what} took over {timeout_s} s")
        if pause_s:
            time.sleep(pause_s)


def interleave(steps: Mapping[str, Callable[[], float]], iterations: int) -> dict[str, list[float]]:
    """Warm every step up, then run them in turn ``iterations`` times; seconds per step."""
    for step in steps.values():
        for _ in range(WARMUP):
            step()
    samples: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(iterations):  # interleaved, so noise hits both variants alike
        for name, step in steps.items():
            samples[name].append(step())
    return samples


def summary(samples_s: list[float]) -> dict[str, float]:
    """Median, p10, p90 and mean of ``samples_s``, in microseconds."""
    us = sorted(s * 1e6 for s in samples_s)
    return {
        "median_us": statistics.median(us),
        "p10_us": us[len(us) // 10],
        "p90_us": us[(len(us) * 9) // 10],
        "mean_us": statistics.fmean(us),
    }


def overhead_report(config: dict[str, Any], samples: Mapping[str, list[float]]) -> dict[str, Any]:
    """``config``, each step's :func:`summary`, and the transport/raw ratios of the medians."""
    out: dict[str, Any] = {"config": config}
    out.update({name: summary(values) for name, values in samples.items()})
    out["notif_rtt_overhead_ratio"] = (
        out["notif_rtt_transport"]["median_us"] / out["notif_rtt_raw"]["median_us"]
    )
    out["read_overhead_ratio"] = out["read_transport"]["median_us"] / out["read_raw"]["median_us"]
    return out
