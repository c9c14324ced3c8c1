"""The transport conformance kit, shipped inside the package (like trio's ``_check_streams``).

A transport author provides a :class:`TransportFactory` (how to make a group
of connected endpoints, give them memory, kill and restart one, and whose
clock to wait on) and runs::

    from kvproto_transports.conformance import run_conformance
    report = run_conformance(my_factory, strict=False)

or ``kvproto conformance --transport NAME`` once the factory is registered in
the ``kvproto.transports`` entry-point group, or, under pytest,
``test_x = pytest_cases(my_factory)``. See ``spec/transport-authors.md``.
"""

from kvproto_transports.conformance.discovery import (
    GROUP,
    UnknownTransport,
    available,
    load_factory,
)
from kvproto_transports.conformance.factory import (
    EndpointGroup,
    RealTimeGroup,
    TransportFactory,
)
from kvproto_transports.conformance.hostmem import HostMemory
from kvproto_transports.conformance.model import CaseResult, Level, Report, Verdict
from kvproto_transports.conformance.pytest_entry import ConformanceWarning, pytest_cases
from kvproto_transports.conformance.registry import Case, all_cases
from kvproto_transports.conformance.runner import run_case, run_conformance

__all__ = [
    "GROUP",
    "Case",
    "CaseResult",
    "ConformanceWarning",
    "EndpointGroup",
    "HostMemory",
    "Level",
    "RealTimeGroup",
    "Report",
    "TransportFactory",
    "UnknownTransport",
    "Verdict",
    "all_cases",
    "available",
    "load_factory",
    "pytest_cases",
    "run_case",
    "run_conformance",
]
