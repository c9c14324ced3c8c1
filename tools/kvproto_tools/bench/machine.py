"""What the figures were measured on (the ``machine`` object of the JSON report)."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def describe(*, quick: bool, elapsed_s: float | None = None) -> dict[str, Any]:
    """Host, interpreter and library versions, and how the run was made."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "kvproto": _version("kvproto"),
        "msgspec": _version("msgspec"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "clock": "time.perf_counter_ns; medians of interleaved repetitions",
    }
    with contextlib.suppress(OSError):
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)
    if elapsed_s is not None:
        info["elapsed_s"] = round(elapsed_s, 1)
    return info
