"""The worker's transport, chosen by ``kv_transport`` in ``kv_connector_extra_config``.

``"nixl"`` (default) builds a :class:`~kvproto_transports.nixl.NixlTransport`,
``"ucx"`` a :class:`~kvproto_transports.ucx.UcxTransport` (ucxx), ``"mooncake"``
a :class:`~kvproto_transports.mooncake.MooncakeTransport` (Mooncake's transfer
engine over TCP, notifications over ZMQ). Everything else -- lease keys, side
channel (``VLLM_NIXL_SIDE_CHANNEL_HOST``/``PORT``, ``kvproto_side_channel_port``),
``auth_secret``, ``probe_interval_s`` -- means the same with each: the worker
only talks to the Transport protocol (:mod:`kvproto.transport`) and the side
channel carries whichever transport's ``metadata()``.

Why a fixed table and not the ``kvproto.transports`` entry points: those
name the conformance kit's factories (test endpoints over the kit's host
memory), and one of them is the in-process loopback, which cannot link two
engines. The adapter needs production constructors fed from this config.

Each transport is imported only when chosen: NIXL and ucxx each bundle their
own libucx (and NIXL its own libibverbs, where Mooncake's engine links the
system's), so an engine running one never loads another.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvproto_binding.sidechannel import CompatMismatch, HandshakeClient, HandshakeFailed

from .config import KV_TRANSPORTS

if TYPE_CHECKING:
    from kvproto.transport import Transport
    from kvproto_binding.sidechannel.client import HandshakeResult

    from .config import AdapterConfig

log = logging.getLogger("vllm.kvproto_connector.worker")


def _nothing() -> None:
    return


@dataclass(frozen=True, slots=True, kw_only=True)
class ChosenTransport:
    """A started transport endpoint and what the worker must do around it."""

    kind: str
    """The ``kv_transport`` value that built it."""
    transport: Transport
    """The endpoint (not yet registered)."""
    enter_thread: Callable[[], None] = _nothing
    """Call before using the endpoint on the current thread: NIXL's owner-thread rule
    (``adopt_current_thread``, vLLM may move the worker between threads); a no-op for
    transports callable from any thread."""


def _nixl(cfg: AdapterConfig, name_prefix: str) -> ChosenTransport:
    from kvproto_transports.nixl import NixlTransport

    transport = NixlTransport(
        name_prefix=name_prefix,
        backends=cfg.backends,
        # NIXL's progress thread, waiting between passes instead of spinning a core: over
        # TCP it answers a reader's READs while the engine step computes, where UCX would
        # abort a holder that answered a dead reader's queued READs late (NixlTransport's
        # progress_thread). The worker still polls every step for its events.
        progress_thread=cfg.nixl_progress_thread,
        auto_probe_interval_s=cfg.probe_interval_s,
    )
    return ChosenTransport(
        kind="nixl", transport=transport, enter_thread=transport.adopt_current_thread
    )


def _ucx(cfg: AdapterConfig, name_prefix: str) -> ChosenTransport:
    from kvproto_transports.ucx import UcxTransport

    # UCX progress runs on the transport's own engine thread (it sleeps when idle); every
    # method is callable from any thread. TCP only unless UCX_TLS says otherwise.
    transport = UcxTransport(
        name_prefix=name_prefix,
        probe_interval_s=cfg.probe_interval_s,
        connect_timeout_s=cfg.handshake_timeout_s,
    )
    return ChosenTransport(kind="ucx", transport=transport)


def _mooncake(cfg: AdapterConfig, name_prefix: str) -> ChosenTransport:
    from vllm import envs

    from kvproto_transports.mooncake import MooncakeTransport

    # Unlike NIXL and UCX (whose metadata carries a worker address), the transfer engine
    # and the notification socket listen on a host name that goes into metadata() as is:
    # the side channel's host, which the operator already set to where peers reach this
    # engine (VLLM_NIXL_SIDE_CHANNEL_HOST). The prober runs on the transport's own thread
    # (send_probe blocks); every method is callable from any thread.
    transport = MooncakeTransport(
        name_prefix=name_prefix,
        host=envs.VLLM_NIXL_SIDE_CHANNEL_HOST,
        probe_interval_s=cfg.probe_interval_s,
    )
    return ChosenTransport(kind="mooncake", transport=transport)


BUILDERS: dict[str, Callable[[AdapterConfig, str], ChosenTransport]] = {
    "nixl": _nixl,
    "ucx": _ucx,
    "mooncake": _mooncake,
}
"""``kv_transport`` value -> constructor; keys equal :data:`.config.KV_TRANSPORTS`."""

assert tuple(BUILDERS) == KV_TRANSPORTS


def build_transport(cfg: AdapterConfig, *, name_prefix: str) -> ChosenTransport:
    """Start the endpoint ``cfg.kv_transport`` names (validated by ``parse_extra_config``)."""
    return BUILDERS[cfg.kv_transport](cfg, name_prefix)


class TransportAwareClient(HandshakeClient):
    """The side-channel client, naming the difference when a compat mismatch has one cause.

    A compat mismatch is only a differing hash. If the holder's hash equals ours with
    one factor changed (another ``kv_transport``, block size, dtype, MLA:
    :func:`.compat.neighbour_hashes`), say which and how: the fix is then one setting.
    """

    def __init__(
        self,
        *,
        kv_transport: str,
        neighbours: dict[bytes, tuple[str, Any]],
        factors: dict[str, Any],
        record: Callable[[str, str, str], None],
        requester: str,
        compat_hash: bytes,
        secret: bytes | None,
        requester_metadata: bytes,
        timeout_s: float,
        max_attempts: int,
    ) -> None:
        super().__init__(
            requester=requester,
            compat_hash=compat_hash,
            secret=secret,
            requester_metadata=requester_metadata,
            timeout_s=timeout_s,
            max_attempts=max_attempts,
        )
        self.kv_transport = kv_transport
        """This engine's transport."""
        self.neighbours = neighbours
        """compat hash -> (factor, value) that gives it, the rest as ours
        (:func:`.compat.neighbour_hashes`)."""
        self.factors = factors
        """Our compat factors (what a difference is logged against)."""
        self.record = record
        """The worker's decision log: (kind, subject, detail)."""
        self.transport_mismatches = 0
        """Handshakes refused because the holder runs another transport."""

    def poll_results(self) -> list[HandshakeResult]:
        results = super().poll_results()
        for res in results:
            if isinstance(res, HandshakeFailed) and isinstance(res.error, CompatMismatch):
                found = self.neighbours.get(res.error.theirs)
                if found is None:
                    continue
                key, theirs = found
                kind = "transport" if key == "kv_transport" else key.replace("_", "-")
                self.record(f"{kind}-mismatch", f"{res.host}:{res.port}", str(theirs))
                if key == "kv_transport":
                    self.transport_mismatches += 1
                    log.error(
                        "KV handshake with %s:%d refused: that prefill engine uses "
                        "kv_transport %r, this engine %r. Set the same kv_transport in "
                        "kv_connector_extra_config on both engines.",
                        res.host,
                        res.port,
                        theirs,
                        self.kv_transport,
                    )
                else:
                    log.error(
                        "KV handshake with %s:%d refused: that prefill engine runs with %s "
                        "%r, this engine with %r; the engines differ in nothing else the "
                        "handshake compares. Run both with the same %s.",
                        res.host,
                        res.port,
                        key,
                        theirs,
                        self.factors.get(key),
                        key,
                    )
        return results
