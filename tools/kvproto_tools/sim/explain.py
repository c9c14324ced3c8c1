"""``kvproto simulate --explain``: what every figure of the table means.

spec/simulator.md is the simulator's manual, but a wheel does not ship spec/,
so the definitions a user needs to read the table travel in the package. They
restate the manual's "Figures" and "Oracles" sections;
tests/sim/test_explain.py holds the two to the same list of figures.
"""

from __future__ import annotations

from kvproto_tools.sim.console import Out
from kvproto_tools.sim.model import METRIC_KEYS
from kvproto_tools.sim.policies import POLICIES
from kvproto_tools.sim.scenarios import SCENARIOS

HOLD = (
    "A hold is one request's blocks at its holder engine (turn 1 on the prefill engine, "
    "turn 2 on the decoder). It ends when every holder rank has freed it, or when the "
    "holder dies (its memory vanishes: not a free)."
)

FIGURES: dict[str, str] = {
    "reclaim_s": (
        "with a decoder crash: seconds from the crash until every hold that the crashed "
        "decoder was going to read had ended (if one never ends: until the run's end); with "
        "router drops: the longest a dropped request's hold lasted after its drop; "
        "'-' (JSON null) in a scenario without either. With several seeds: the mean, and "
        "the worst seed in brackets. Push scenarios: from the prefill engine's crash until "
        "every decoder block that waited for its writes was given back (used or recomputed "
        "into); never (the run's cap) while one stays stranded."
    ),
    "dead_block_seconds": (
        "the sum over holds of blocks x (end - the moment no live reader would use them "
        "any more: its reader crashed, gave up, or had copied all its data). Push "
        "scenarios: decoder blocks x seconds spent waiting for a crashed prefill engine."
    ),
    "premature_frees": (
        "holds freed while their request was on its way to, or waiting or reading at, a "
        "live reader that had not copied all its data. kvproto shows some where a reader "
        "cannot heartbeat in time (a stalled step, a cut link): its read is then fenced and "
        "recomputed, never served. Push scenarios: decoder blocks given up (recomputed "
        "into) while the live prefill engine still meant to write them."
    ),
    "overlapped_reads": (
        "requests whose loaded blocks were used although at least one of their reads "
        "completed after the hold was freed: the blocks may have been overwritten, so the "
        "output may be silently corrupt."
    ),
    "wasted_prefill_tokens": (
        "tokens recomputed because prefilled blocks could not be used (the prompt for turn "
        "1, prompt + output for turn 2): declined or fenced reads, lost leases, failed reads "
        "or handshakes. Requests lost with a crashed decoder are not counted. Push "
        "scenarios: prompts the decoder recomputed because the pushed KV was not used."
    ),
    "heartbeat_bytes": (
        "keep-alive bytes put on the wire: vLLM's HB: frames; kvproto's Heartbeat and "
        "HeartbeatAck frames (both directions count). Push scenarios: what keeps the "
        "decoder's waiting blocks (kvproto's writer heartbeats and acks; the baselines send none)."
    ),
    "heartbeat_messages": "keep-alive messages put on the wire, counted as heartbeat bytes are.",
    "safety_violations": (
        "safety oracle failures: S1 use after free, S2 a holder's deadline shortened, "
        "S3 a hold resurrected or leaked, S4 a double free, S0 wrong bytes without an "
        "overlapping free (a simulator bug). kvproto's are bugs and make the command exit 1."
        " Push mode: S1w a WRITE landed in blocks the decoder had let go, S0 used blocks that "
        "do not hold the request's KV."
    ),
    "written_freed": (
        "push scenarios: WRITEs from the prefill engine whose data landed in decoder blocks "
        "that no longer waited for them (given up and recomputed into, or handed to another "
        "request): the push twin of used freed, silent corruption. 0 in pull scenarios."
    ),
}
"""Per JSON metric key: its definition (the table's column is ``report.LABELS[key][0]``)."""

LIVENESS = (
    "(with --liveness) liveness bound failures: L1 a crashed decoder's hold outlives "
    "max(grant + d, last heartbeat + e) + one holder step; L2 a read whose data arrived is "
    "neither used nor recomputed within two reader steps; L3 a hold left when the run ends."
)

SEEDS = (
    "With several seeds the table sums the counts (premature, used freed, unsafe) and "
    "averages every other figure per run; the JSON has one entry per run, rounded to the "
    "millisecond."
)


def explain(out: Out, labels: dict[str, tuple[str, str]]) -> None:
    """Print every column's definition, then the policies and scenarios.

    ``labels`` is the table's (``report.LABELS``), passed in so this module
    stays below the report in the import graph.
    """
    out.print("[bold]kvproto simulate: what the table's figures mean[/bold]")
    out.print(HOLD)
    out.print("[bold]Columns[/bold] (JSON metrics key in brackets)")
    for key in METRIC_KEYS:
        out.print(f"  [bold]{labels[key][0]}[/bold] ({key}): {FIGURES[key]}")
    out.print(f"  [bold]liveness[/bold]: {LIVENESS}")
    out.print(SEEDS)
    out.print("[bold]Policies[/bold]")
    for name, policy in POLICIES.items():
        out.print(f"  [bold]{name}[/bold]: {policy.summary}")
    out.print("[bold]Scenarios[/bold]")
    for name, scenario in SCENARIOS.items():
        out.print(f"  [bold]{name}[/bold]: {scenario.summary}")
