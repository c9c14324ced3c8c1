"""What a chaos run recorded: every request, fault, metrics sample and process exit.

The checker (:mod:`.checker`) reads only this, so it runs the same on a live
run, on a saved ``history.json`` and on a history made up by a test. Times are
seconds since the load started (the run's monotonic clock).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvproto_tools.chaos.answers import Choice
from kvproto_tools.chaos.schedule import Fault, Plan, Request

OUTCOMES = ("ok", "error", "cancelled")
"""How a request ended for its client."""


class Sent(msgspec.Struct, frozen=True, kw_only=True):
    """One request as the client saw it."""

    index: int
    """The planned request (``Plan.requests[index]``)."""
    sent: float
    """When the client sent it."""
    ended: float
    """When the answer was complete, the error came, or the client hung up."""
    outcome: str
    """One of :data:`OUTCOMES`."""
    choices: tuple[Choice, ...] = ()
    """The answer, one per choice (``ok`` only)."""
    error: str = ""
    """What went wrong (``error``), shortened."""


class Injected(msgspec.Struct, frozen=True, kw_only=True):
    """One fault as the run applied it."""

    fault: Fault
    """The planned fault."""
    start: float
    """When it was applied (the kill signal, the first rule, the first link down)."""
    end: float
    """When it was over: healed, the last link up, or the restarted engine healthy."""
    restarted: bool = True
    """Kills: whether the engine came back (False: its restart failed; see ``detail``)."""
    detail: str = ""
    """Anything the run noticed while applying it."""


class EngineSample(msgspec.Struct, frozen=True, kw_only=True):
    """One engine's figures in one sample."""

    name: str
    """The engine ("prefill-0"...)."""
    incarnation: int
    """1 at the start, one more after each restart."""
    metrics: dict[str, float] | None
    """Its ``vllm:`` figures kept by the run (None: /metrics did not answer)."""
    rss_bytes: int | None = None
    """Resident memory of its whole process tree (None: not measured in this sample)."""
    rss_parts: dict[str, int] | None = None
    """The same by process name (the API server, ``VLLM::EngineCore``, ``VLLM::Worker``)."""


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """Every engine's figures, scraped together."""

    t0: float
    """When the scrape began."""
    t1: float
    """When the last engine answered."""
    engines: tuple[EngineSample, ...]
    """One per engine."""


class Exit(msgspec.Struct, frozen=True, kw_only=True):
    """A process of the deployment that ended while the run went on."""

    t: float
    """When the run saw it gone."""
    name: str
    """The process ("decode-0", "router"...)."""
    returncode: int | None
    """Its exit status (negative: the signal)."""
    scheduled: bool
    """Whether the schedule killed it."""
    log_tail: str = ""
    """The last lines of its log (for an exit nobody scheduled)."""


class History(msgspec.Struct, kw_only=True):
    """One chaos run."""

    plan: Plan
    """The schedule it ran."""
    rate: float
    """Steady requests per second of the plan."""
    warmup_s: float
    """Seconds of load before the first fault."""
    sample_s: float
    """Seconds between two metrics samples."""
    layout: str
    """Which engines on which cores, in words."""
    load_end: float = 0.0
    """When the last planned request was sent."""
    end: float = 0.0
    """When recording stopped (after the leases settled)."""
    sent: list[Sent] = msgspec.field(default_factory=list)
    """Every request sent, in order of ending."""
    injected: list[Injected] = msgspec.field(default_factory=list)
    """Every fault applied, in order."""
    samples: list[Sample] = msgspec.field(default_factory=list)
    """The metrics samples, in time order."""
    exits: list[Exit] = msgspec.field(default_factory=list)
    """Processes that ended during the run."""
    startup_s: dict[str, float] = msgspec.field(default_factory=dict)
    """Seconds each process took to become healthy at the start."""

    def request(self, index: int) -> Request:
        """The planned request behind ``Sent.index``."""
        return self.plan.requests[index]

    def save(self, path: Path) -> None:
        """Write as JSON."""
        path.write_bytes(msgspec.json.encode(self))

    @staticmethod
    def load(path: Path) -> History:
        """Read a saved history."""
        return msgspec.json.decode(path.read_bytes(), type=History)
