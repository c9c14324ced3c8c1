"""What a flow, an oracle or a fault sees of a run: one small typed part per concern.

The event loop (:class:`kvproto_tools.sim.engine.Simulator`) owns the run and
hands this context to the functions in :mod:`.flows`, :mod:`.checks`,
:mod:`.faults` and :mod:`.handshake`. None of them imports the loop: what
they may ask of it is :class:`Steps`, so the modules form no import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvproto_tools.sim.agenda import Agenda
    from kvproto_tools.sim.books import Books
    from kvproto_tools.sim.cluster import Cluster
    from kvproto_tools.sim.fabric import Fabric
    from kvproto_tools.sim.model import EngineState
    from kvproto_tools.sim.policies import Policy
    from kvproto_tools.sim.scenarios import Scenario
    from kvproto_tools.sim.settings import Settings


class Steps(Protocol):
    """The engines' step loop, as the flows drive it."""

    def request_wake(self, eng: EngineState, t: float) -> None:
        """Make ``eng`` step at its first boundary at or after global time ``t``."""

    def effects(self, eng: EngineState) -> None:
        """Act on everything ``eng``'s side reported, until it is quiet."""

    def start_engine(self, eng: EngineState) -> None:
        """Bring up the next incarnation of ``eng``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """One run's parts, each behind its own small interface."""

    clock: Agenda
    """Global virtual time and what is due when."""
    books: Books
    """Figures, counters, trace and violations."""
    cluster: Cluster
    """The engines (and their sides) and the requests in the system."""
    fabric: Fabric
    """The network: links, endpoints, reads in flight."""
    steps: Steps
    """The engines' step loop."""
    scenario: Scenario
    """What is simulated."""
    policy: Policy
    """How engines keep blocks for a reader."""
    settings: Settings
    """The model constants."""
    liveness: bool
    """Whether the liveness bounds (L1-L3) are checked."""
