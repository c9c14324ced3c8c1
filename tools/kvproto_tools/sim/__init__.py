"""Deterministic lease simulator: the real core over the loopback transport.

``run(scenario, policy, seed)`` simulates one run and returns its figures;
:mod:`kvproto_tools.sim.sweep` runs many, :mod:`kvproto_tools.sim.report`
prints and plots them. spec/simulator.md is the manual.
"""

from kvproto_tools.sim.engine import RunResult, SimError, Simulator, run
from kvproto_tools.sim.model import METRIC_KEYS
from kvproto_tools.sim.oracles import Violation
from kvproto_tools.sim.policies import POLICIES, Policy
from kvproto_tools.sim.scenarios import DEFAULT_SET, FAULT_SCENARIOS, SCENARIOS, Scenario
from kvproto_tools.sim.settings import Settings

__all__ = [
    "DEFAULT_SET",
    "FAULT_SCENARIOS",
    "METRIC_KEYS",
    "POLICIES",
    "SCENARIOS",
    "Policy",
    "RunResult",
    "Scenario",
    "Settings",
    "SimError",
    "Simulator",
    "Violation",
    "run",
]
