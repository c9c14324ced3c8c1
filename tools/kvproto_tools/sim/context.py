"""What a flow, an oracle or a fault sees of a run: one small typed part per concern.

The event loop (:class:`kvproto_tools.sim.engine.Simulator`) owns the run and
builds one :class:`Context` of all its parts. The functions in :mod:`.flows`,
:mod:`.checks`, :mod:`.faults` and :mod:`.handshake` never take that whole
context: each takes the one part it uses, or, when it uses several, a *view*
below that names exactly those (its callees' included), so a reader of its
signature sees all the state it may touch and mypy holds it to that. The
context satisfies every view. None of these modules imports the loop: what
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


# One protocol per part, each declared once; a view below is the parts it lists.


class HasClock(Protocol):
    @property
    def clock(self) -> Agenda:
        """Global virtual time and what is due when."""


class HasBooks(Protocol):
    @property
    def books(self) -> Books:
        """Figures, counters, trace and violations."""


class HasCluster(Protocol):
    @property
    def cluster(self) -> Cluster:
        """The engines (and their sides) and the requests in the system."""


class HasSteps(Protocol):
    @property
    def steps(self) -> Steps:
        """The engines' step loop."""


class HasPolicy(Protocol):
    @property
    def policy(self) -> Policy:
        """How engines keep blocks for a reader."""


class HasScenario(Protocol):
    @property
    def scenario(self) -> Scenario:
        """What is simulated (faults, link delay, decode step length)."""


class HasSettings(Protocol):
    @property
    def settings(self) -> Settings:
        """The model constants (prefill time, proxy hop, handshake cost and timeout)."""


class HasFabric(Protocol):
    @property
    def fabric(self) -> Fabric:
        """The network: links, endpoints, reads in flight."""


class HasLiveness(Protocol):
    @property
    def liveness(self) -> bool:
        """Whether the liveness bounds (L1-L3) are checked."""


class LedgerView(HasClock, HasBooks, Protocol):
    """The time and the books: grant or end a hold, note, count, report a violation."""


class ClusterView(LedgerView, HasCluster, Protocol):
    """The ledger and the cluster: a request leaves the system or is lost with its engine."""


class WakeView(ClusterView, HasSteps, Protocol):
    """The cluster and the step loop: a request reaches an engine, which must step."""


class FreeView(LedgerView, HasPolicy, Protocol):
    """The ledger and the policy: a holder rank frees a lease (the fence is kvproto's)."""


class GrantView(WakeView, FreeView, HasSettings, Protocol):
    """Blocks are granted and the request routed to its reader: after prefill, and for turn 2."""


class RequestView(GrantView, HasScenario, Protocol):
    """The reader's part of a request's life: track, read, use or recompute, then decode."""


class PrefillView(GrantView, HasScenario, HasLiveness, Protocol):
    """A prefill finishes: its blocks are granted and the request routed, or dropped."""


class CopyView(LedgerView, HasFabric, HasLiveness, Protocol):
    """The ledger and the network: a read's data arrived (and, with liveness, L2 is due)."""


class HandshakeView(WakeView, HasFabric, HasScenario, HasSettings, Protocol):
    """A side-channel handshake: the holder, whether the links are cut, its timing."""


class FaultView(WakeView, HasFabric, HasScenario, HasLiveness, Protocol):
    """The faults: engines die (with their requests and holds), restart; links are cut."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """One run's parts, each behind its own small interface (it satisfies every view)."""

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
