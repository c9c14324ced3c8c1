"""The bounds a chaos run is held to, each computed from its parts (spec/timing.md).

Nothing here is a second figure: every bound is a sum of the protocol's own
constants (the lease timing of ``kv_lease_duration``, the NIXL transport's
failure-detection bound at the adapter's probe interval) and of what the run
measured (the longest gap between P's pumps, the scrape period), plus TCP's
retransmission backoff after a cut (spec/fault-testing.md).

* A decoder killed: P frees every lease that decoder had claimed ``PEER_LOST``
  within the killed tree's exit + the probe interval + the detection slack + P's
  longest pump gap + one scrape (:func:`peer_lost_s`).
* Any fault: every lease P granted until the fault ended and that no live
  request explains is gone by the fault's end + ``d`` (an unclaimed lease lives
  ``d``; a claimed one that no heartbeat reaches dies by ``max(t_last + e,
  grant + d)`` <= its grant + ``d``, the liveness bound) + one pump gap + one
  scrape; after a cut of the fabric (partition, loss, link down) TCP holds the
  frames of the cut back for as long again (its doubled retransmission timer)
  before the first claim of a new lease gets through (:func:`settle_s`).
* A client that hung up or got an error leaves a lease that no live request
  explains for at most ``d`` + one pump gap + one scrape (:func:`orphan_s`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvproto.config import LeaseConfig
from kvproto_tools.chaos.schedule import Fault
from kvproto_transports.nixl.transport import PROBE_DETECTION_SLACK_S
from kvproto_vllm.config import DEFAULT_PROBE_INTERVAL_S

TCP_RTO_INITIAL_S = 1.0
"""TCP's initial retransmission timeout (RFC 6298); Linux starts lower (0.2 s): the larger."""
TCP_RTO_MAX_S = 120.0
"""Linux's ``TCP_RTO_MAX``: the longest TCP waits between two retransmissions."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Terms:
    """What the run measured that a bound adds."""

    pump_gap_s: float
    """The longest gap between two pumps of a prefill engine's lease cores near the fault
    (its ``worker_pump_gap_ms_max`` gauge): how late P applies a timer or a loss report."""
    scrape_s: float
    """One sample period plus the longest scrape near the fault: how late the run sees it."""
    exit_s: float = 0.0
    """After a kill -9, until every process of the killed tree had exited: the kernel
    closes a process's sockets only once it has torn the process down, and until then
    no peer can tell it from a live one (0.76 s for a decoder serving a request on 2
    otherwise quiet cores). 0 where the run does not measure it: a chaos run, whose
    scrape term is its one-second sample period."""


PLANNING_TERMS = Terms(pump_gap_s=2.0, scrape_s=1.0)
"""What a run allows for the measured terms before it has measured them: how long it waits
after a fault before the next, and which samples are out of every fault's reach (the
checker uses what was measured)."""


def lease_timing(lease_s: float) -> LeaseConfig:
    """The lease configuration the engines run with (d, and i and e derived from it)."""
    return LeaseConfig(kv_lease_duration=lease_s)


def peer_lost_s(terms: Terms) -> float:
    """Kill of a decoder to the last of its claimed leases freed on P, as seen by the run."""
    return (
        terms.exit_s
        + DEFAULT_PROBE_INTERVAL_S
        + PROBE_DETECTION_SLACK_S
        + terms.pump_gap_s
        + terms.scrape_s
    )


def tcp_backoff_s(down_s: float) -> float:
    """After a cut of ``down_s``, how long TCP may still wait before it resends.

    Retransmissions leave at ``RTO * (2^k - 1)`` after the first loss; the first
    after the heal is at most the time already waited plus one initial timeout
    later, and never more than ``TCP_RTO_MAX`` apart."""
    return min(down_s + TCP_RTO_INITIAL_S, TCP_RTO_MAX_S)


def orphan_s(lease_s: float, terms: Terms) -> float:
    """A lease whose client hung up or failed: gone this long after the client's end."""
    return lease_timing(lease_s).kv_lease_duration + terms.pump_gap_s + terms.scrape_s


def settle_s(fault: Fault, lease_s: float, terms: Terms) -> float:
    """After ``fault`` ended, how long P may hold leases that no live request explains."""
    settle = orphan_s(lease_s, terms)
    if fault.kind in ("partition", "loss"):
        settle += tcp_backoff_s(fault.length_s)
    elif fault.kind == "flap":
        settle += tcp_backoff_s(fault.down_s)
    return settle
