"""The engines of a run and the requests they serve (the sides live in the engines)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvproto_tools.sim.model import EngineState, Req


class Cluster:
    """Engines by role and name, the requests in the system, and heartbeats seen (L1)."""

    __slots__ = ("decode", "engines", "last_hb", "prefill", "reqs")

    def __init__(self) -> None:
        self.engines: dict[str, EngineState] = {}
        """Every engine by name."""
        self.prefill: list[EngineState] = []
        """Prefill engines, in routing order."""
        self.decode: list[EngineState] = []
        """Decode engines, in routing order."""
        self.reqs: dict[str, Req] = {}
        """Requests in the system, by key."""
        self.last_hb: dict[tuple[str, int, int, str], float] = {}
        """(holder, incarnation, rank, reader) -> holder-clock time of the last heartbeat seen."""

    def add(self, eng: EngineState) -> None:
        """Add an engine under its name and role."""
        (self.decode if eng.role == "D" else self.prefill).append(eng)
        self.engines[eng.name] = eng


def route(engines: list[EngineState], preferred: int) -> EngineState | None:
    """The first live engine from ``preferred`` on (the router skips dead ones)."""
    n = len(engines)
    for i in range(n):
        eng = engines[(preferred + i) % n]
        if eng.alive:
            return eng
    return None
