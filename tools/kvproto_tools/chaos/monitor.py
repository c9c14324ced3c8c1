"""The run's observer: every engine's /metrics and memory, sampled together, and process exits.

A sample scrapes every engine at once (one thread each, bounded waits), so
the prefill engines' lease gauges of one sample are seconds apart at most by
the longest scrape, which the history keeps (``t0``, ``t1``) and the bounds add.
Resident memory is the sum over an engine's whole process tree (API server,
engine core, workers), read from /proc every ``rss_every_s``.
"""

from __future__ import annotations

import contextlib
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

from kvproto_tools.chaos.history import EngineSample, Exit, History, Sample

KEPT = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
"""vLLM's own figures a sample keeps beside every ``vllm:kvproto_*`` one."""
SCRAPE_TIMEOUT_S = 2.0
"""Longest one engine's /metrics may take (a dead engine refuses at once)."""


def kept(metrics: dict[str, float]) -> dict[str, float]:
    """The figures of one /metrics a sample keeps."""
    return {
        k: v
        for k, v in metrics.items()
        if (k.startswith("vllm:kvproto_") and not k.endswith("_created")) or k in KEPT
    }


def tree_rss(pids: list[int]) -> dict[str, int]:
    """Resident bytes of ``pids`` by process name (``/proc/<pid>/comm``: the API server,
    ``VLLM::EngineCore``, ``VLLM::Worker``); processes that end meanwhile count 0."""
    out: dict[str, int] = {}
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out[name] = out.get(name, 0) + int(line.split()[1]) * 1024
                    break
    return out


class Monitor:
    """Samples every engine every ``sample_s`` on a thread of its own until :meth:`stop`."""

    def __init__(
        self,
        *,
        client: ModuleType,
        deployment: Any,
        history: History,
        clock: Callable[[], float],
        incarnation: dict[str, int],
        scheduled: set[str],
        rss_every_s: float = 2.0,
    ) -> None:
        self._client = client
        self._deployment = deployment
        self._history = history
        self._clock = clock
        self._incarnation = incarnation
        self._scheduled = scheduled
        self._rss_every_s = rss_every_s
        self._stop = threading.Event()
        self._seen_dead: set[int] = set()
        self._thread = threading.Thread(target=self._loop, name="chaos-monitor", daemon=True)
        self._urls = {
            spec.name: spec.url for spec in [*deployment.prefill_specs, deployment.decode_spec]
        }

    def start(self) -> None:
        """Start sampling (the thread starts in the caller's network namespace)."""
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling and wait for the thread."""
        self._stop.set()
        self._thread.join(10.0)

    def _loop(self) -> None:
        period = self._history.sample_s
        next_rss = 0.0
        with ThreadPoolExecutor(len(self._urls), thread_name_prefix="chaos-scrape") as pool:
            while not self._stop.is_set():
                t0 = self._clock()
                rss = t0 >= next_rss
                if rss:
                    next_rss = t0 + self._rss_every_s
                scraped = dict(
                    zip(self._urls, pool.map(self._scrape, self._urls.values()), strict=True)
                )
                engines = []
                for name, got in scraped.items():
                    parts = self._rss(name) if rss else None
                    engines.append(
                        EngineSample(
                            name=name,
                            incarnation=self._incarnation[name],
                            metrics=got,
                            rss_bytes=None if parts is None else sum(parts.values()),
                            rss_parts=parts,
                        )
                    )
                self._history.samples.append(
                    Sample(t0=t0, t1=self._clock(), engines=tuple(engines))
                )
                self._exits()
                self._stop.wait(max(0.0, t0 + period - self._clock()))

    def _scrape(self, url: str) -> dict[str, float] | None:
        try:
            with urllib.request.urlopen(url + "/metrics", timeout=SCRAPE_TIMEOUT_S) as reply:
                text = reply.read().decode()
        except (urllib.error.URLError, OSError, ValueError):
            return None
        parsed: dict[str, float] = self._client.parse_prometheus(text)
        return kept(parsed)

    def _rss(self, name: str) -> dict[str, int] | None:
        proc = self._deployment.procs.get(name)
        if proc is None or not proc.alive():
            return None
        return tree_rss(proc.tree())

    def _exits(self) -> None:
        for name, proc in list(self._deployment.procs.items()):
            if proc.alive() or proc.pid in self._seen_dead:
                continue
            self._seen_dead.add(proc.pid)
            scheduled = name in self._scheduled
            self._history.exits.append(
                Exit(
                    t=self._clock(),
                    name=name,
                    returncode=proc.popen.returncode,
                    scheduled=scheduled,
                    log_tail="" if scheduled else proc.log_tail(40),
                )
            )
