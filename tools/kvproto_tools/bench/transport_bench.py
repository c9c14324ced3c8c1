"""Transport overhead: kvproto over a transport beside the same transport's raw calls.

Loopback is always measured here (the binding :class:`Binding` driving a
real holder and reader over two loopback endpoints, beside bare
``send``/``poll``/``read_blocks`` with payloads of the same size). NIXL and
UCX bring their own ``measure_overhead()`` (written with their transports);
they are included when importable, else skipped with the reason printed.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from kvproto import wire
from kvproto.config import LeaseConfig
from kvproto.events import SendFrame
from kvproto.holder import Holder
from kvproto.reader import Reader
from kvproto_binding.step import Binding
from kvproto_tools.bench.figures import Figure
from kvproto_tools.bench.plan import Plan
from kvproto_tools.bench.timing import paired_ns, quiet_gc
from kvproto_transports.loopback import DEFAULT_MAX_NOTIFICATION_SIZE, LoopbackNetwork

READ_BLOCKS = 64
BLOCK_LEN = 4096
REGIONS = 2
EXTERNAL = {
    "nixl": "kvproto_transports.nixl.bench",
    "ucx": "kvproto_transports.ucx.bench",
    "mooncake": "kvproto_transports.mooncake.bench",
}


class _Loop:
    """A holder endpoint P and a reader endpoint D on a perfect loopback link."""

    def __init__(self, leases: int) -> None:
        # max_hold is lifted only so that hundreds of simulated heartbeat
        # intervals can pass in one benchmark; it costs nothing per step.
        config = LeaseConfig(max_notification_size=DEFAULT_MAX_NOTIFICATION_SIZE, max_hold=1e9)
        self.net = LoopbackNetwork(seed=1)
        self.p_ep = self.net.endpoint("P")
        self.d_ep = self.net.endpoint("D")
        for ep in (self.p_ep, self.d_ep):
            ep.register_blocks(ep.allocate_layout(REGIONS, BLOCK_LEN, READ_BLOCKS))
        holder = Holder(config, engine="P", incarnation=1)
        reader = Reader(config, engine="D", incarnation=2)
        self.holder = holder
        self.reader = reader
        self.p = Binding(self.p_ep, holder=holder)
        self.d = Binding(self.d_ep, reader=reader)
        self.d_to_p = self.d_ep.add_peer(self.p_ep.metadata())
        self.p_to_d = self.p_ep.add_peer(self.d_ep.metadata())
        self.interval = config.heartbeat_interval
        self.request_ids = [f"r{i}" for i in range(leases)]
        for rid in self.request_ids:
            reader.track(0.0, request_id=rid, ticket=holder.grant(0.0, request_id="p-" + rid))
        self.confirmed = 0
        self.t = 0.0
        for _ in range(16):  # connect, claim (and the resync a split claim causes), settle
            sent = reader.stats.heartbeats_sent
            self.round(self.t)
            steady = reader.stats.heartbeats_sent - sent == 1
            if steady and holder.stats_snapshot()["leases_held"] == leases:
                return
            self.t += self.interval
        raise RuntimeError("loopback session did not reach the steady state")

    def round(self, t: float) -> None:
        """Step D, deliver, step P, deliver, step D (one exchange each way)."""
        self.net.advance(t)
        result = self.d.step(t)
        for c in result.connects:
            self.d.connected(t, engine=c.engine, rank=c.rank, metadata=self.p_ep.metadata())
        self.net.advance(t)
        self.p.step(t)
        self.net.advance(t)
        self.confirmed += len(self.d.step(t).confirmed)

    def cores_round(self, t: float) -> None:
        """The same exchange with the frames handed from core to core: no endpoint, no link.

        What any authenticated heartbeat round costs (encode, MAC, verify, apply
        on both sides); :meth:`round` minus this is the binding's and the
        transport's share, the part comparable with the raw round trip."""
        self.reader.handle_timer(t)
        for out in self.reader.drain():
            if isinstance(out, SendFrame):
                self.holder.handle_frame(t, self.p_to_d, out.payload)
        for answer in self.holder.drain():
            if isinstance(answer, SendFrame):
                self.reader.handle_frame(t, self.d_to_p, answer.payload)
        self.reader.drain()


def _loopback(plan: Plan) -> list[Figure]:
    reads = (plan.repeats + 1) * plan.loopback_rounds
    loop = _Loop(leases=reads)
    raw = _Loop(leases=1)
    return [*_heartbeat_rtt(plan, loop, raw), *_read64(plan, loop, raw, reads)]


def _heartbeat_rtt(plan: Plan, loop: _Loop, raw: _Loop) -> list[Figure]:
    """One heartbeat round through the binding, and the cores' share of it, beside raw."""
    # Raw payloads as large as what kvproto sends in the steady state.
    sent, nbytes = loop.reader.stats.heartbeats_sent, loop.reader.stats.heartbeat_bytes
    loop.t += loop.interval
    loop.round(loop.t)
    hb_len = (loop.reader.stats.heartbeat_bytes - nbytes) // max(
        1, loop.reader.stats.heartbeats_sent - sent
    )
    ack_len = len(wire.encode(wire.HeartbeatAck(seq=1000, clock=loop.t, held=[], lost=[])))
    raw_hb, raw_ack = b"\x00" * hb_len, b"\x00" * ack_len
    acks_before = loop.reader.stats.acks

    def ours_rtt() -> None:
        loop.t += loop.interval
        loop.round(loop.t)

    def raw_rtt() -> None:
        raw.t += 1e-3
        raw.d_ep.send(raw.d_to_p, raw_hb)
        raw.net.advance(raw.t)
        raw.p_ep.poll()
        raw.p_ep.send(raw.p_to_d, raw_ack)
        raw.net.advance(raw.t)
        raw.d_ep.poll()

    cores = _Loop(leases=len(loop.request_ids))
    cores_acks = cores.reader.stats.acks

    def cores_rtt() -> None:
        cores.t += cores.interval
        cores.cores_round(cores.t)

    with quiet_gc():
        kv_rtt, raw_ns = paired_ns(
            ours_rtt, raw_rtt, batch=plan.loopback_rounds, repeats=plan.repeats
        )
        cores_ns, raw_again_ns = paired_ns(
            cores_rtt, raw_rtt, batch=plan.loopback_rounds, repeats=plan.repeats
        )
    for acked in (loop.reader.stats.acks - acks_before, cores.reader.stats.acks - cores_acks):
        if acked < plan.loopback_rounds * (plan.repeats + 1):
            raise RuntimeError("loopback heartbeat rounds did not each get an acknowledgement")

    return [
        Figure(
            name="transport.loopback.heartbeat_rtt",
            size=None,
            value=kv_rtt / 1e3,
            unit="us",
            anchor="raw loopback send/poll round trip",
            anchor_value=raw_ns / 1e3,
        ),
        Figure(
            name="transport.loopback.heartbeat_rtt_cores",
            size=None,
            value=cores_ns / 1e3,
            unit="us",
            anchor="raw loopback send/poll round trip",
            anchor_value=raw_again_ns / 1e3,
        ),
    ]


def _read64(plan: Plan, loop: _Loop, raw: _Loop, reads: int) -> list[Figure]:
    """A confirmed 64-block read through the binding beside a raw read + notify."""
    ids = iter(loop.request_ids)
    blocks = list(range(READ_BLOCKS))
    done_len = 4 + 1 + 1 + 1 + 9 + 18  # header, array, tag, claim array, lease id, proof
    notify = b"\x00" * done_len

    def ours_read() -> None:
        loop.t += 1e-3
        rid = next(ids)
        loop.d.start_read(loop.t, rid, local_blocks=blocks, remote_blocks=blocks)
        loop.round(loop.t)
        loop.reader.finish(loop.t, rid)

    def raw_read() -> None:
        raw.t += 1e-3
        raw.d_ep.read_blocks(raw.d_to_p, local_blocks=blocks, remote_blocks=blocks, notify=notify)
        raw.net.advance(raw.t)
        raw.d_ep.poll()
        raw.p_ep.poll()

    with quiet_gc():
        kv_read, raw_read_ns = paired_ns(
            ours_read, raw_read, batch=plan.loopback_rounds, repeats=plan.repeats
        )
    if loop.confirmed < reads:
        raise RuntimeError(f"only {loop.confirmed} of {reads} loopback reads were confirmed")
    return [
        Figure(
            name="transport.loopback.read64_confirmed",
            size=READ_BLOCKS,
            value=kv_read / 1e3,
            unit="us",
            anchor="raw loopback 64-block read + notify",
            anchor_value=raw_read_ns / 1e3,
        ),
    ]


def _unit_of(key: str) -> str:
    for suffix, unit in (("_us", "us"), ("_ms", "ms"), ("_ns", "ns"), ("_s", "s"), ("_bytes", "B")):
        if key.endswith(suffix):
            return unit
    return ""


def _median(val: object) -> float | None:
    if isinstance(val, Mapping) and isinstance(val.get("median_us"), (int, float)):
        return float(val["median_us"])
    return None


def figures_from_mapping(prefix: str, data: Mapping[str, Any]) -> list[Figure]:
    """Turn a transport's ``measure_overhead()`` result into figures.

    Understood, in this order:

    * pairs ``<x>_transport`` / ``<x>_raw`` of summaries with ``median_us``
      (the NIXL and UCX benches): one figure ``<prefix>.<x>``, the transport's
      median beside the raw library's (their ``*_ratio`` keys are derived, skipped);
    * a :class:`Figure`;
    * a mapping with ``value`` (and optionally ``name``, ``size``, ``unit``,
      ``anchor``, ``anchor_value``);
    * a bare number (unit from a ``_us``/``_ms``/``_ns``/``_bytes`` suffix).

    Anything else (``config``, strings) is ignored.
    """
    out: list[Figure] = []
    used: set[str] = set()
    for key, val in data.items():
        if not key.endswith("_transport"):
            continue
        base = key[: -len("_transport")]
        ours, raw = _median(val), _median(data.get(f"{base}_raw"))
        if ours is None or raw is None:
            continue
        used |= {key, f"{base}_raw", f"{base}_overhead_ratio", f"{base}_ratio"}
        label = prefix.rsplit(".", 1)[-1]
        out.append(
            Figure(
                name=f"{prefix}.{base}",
                size=None,
                value=ours,
                unit="us",
                anchor=f"raw {label} calls",
                anchor_value=raw,
            )
        )
    for key, val in data.items():
        if key in used or key.endswith("_ratio"):
            continue
        if isinstance(val, Figure):
            out.append(val)
        elif isinstance(val, Mapping) and isinstance(val.get("value"), (int, float)):
            anchor_value = val.get("anchor_value")
            out.append(
                Figure(
                    name=str(val.get("name", f"{prefix}.{key}")),
                    size=val.get("size"),
                    value=float(val["value"]),
                    unit=str(val.get("unit", _unit_of(key))),
                    anchor=val.get("anchor"),
                    anchor_value=None if anchor_value is None else float(anchor_value),
                )
            )
        elif isinstance(val, (int, float)) and not isinstance(val, bool):
            out.append(
                Figure(name=f"{prefix}.{key}", size=None, value=float(val), unit=_unit_of(key))
            )
    return out


def _external(name: str, module: str, say: Callable[[str], None], iterations: int) -> list[Figure]:
    try:
        mod = importlib.import_module(module)
        measure = mod.measure_overhead
    except Exception as exc:  # ImportError, or the library itself failing to load
        say(f"transport.{name}: skipped ({module} not importable: {type(exc).__name__}: {exc})")
        return []
    kwargs: dict[str, Any] = {}
    with contextlib.suppress(TypeError, ValueError):
        if "iterations" in inspect.signature(measure).parameters:
            kwargs["iterations"] = iterations
    try:
        result = measure(**kwargs)
    except Exception as exc:
        say(f"transport.{name}: skipped (measure_overhead() failed: {type(exc).__name__}: {exc})")
        return []
    if not isinstance(result, Mapping):
        say(f"transport.{name}: skipped (measure_overhead() returned {type(result).__name__})")
        return []
    return figures_from_mapping(f"transport.{name}", result)


def measure(plan: Plan, say: Callable[[str], None], *, external: bool = True) -> list[Figure]:
    """Loopback figures, plus NIXL and UCX ones where their bench modules import."""
    figures = _loopback(plan)
    if external:
        for name, module in EXTERNAL.items():
            figures += _external(name, module, say, plan.external_iterations)
    return figures
