"""P, scheduler side: grant a lease when a prefill request finishes.

``request_finished`` (all KV groups) mints a :class:`~kvproto.ticket.LeaseTicket`
for the finished request's blocks, returns ``kv_transfer_params`` with the
fields a stock decoder and proxy expect plus ``{"kvproto": ticket}``, and
tells vLLM to keep the blocks: they are freed only when a worker reports the
request in ``finished_sending``, which it does when its Holder says the lease
ended (read done, expired, aborted, reader lost...). The ticket reaches the
workers in the next step's metadata.

The incarnation is drawn here, once per engine start, and sent to the
workers with every step, so all TP ranks' Holders agree with the tickets.

Bidirectional turn 2 (``bidirectional_kv_xfer``) uses the same minting on the
decode engine: :meth:`HolderScheduler.request_finished` with ``turn2=True`` keeps a
finished decode request's blocks (prompt and output) for
``decoder_kv_blocks_ttl`` and returns stock's turn-2 fields
(``do_remote_decode``, D's block ids and address, ``remote_num_tokens``) plus
the ticket, which the client sends back with its turn-2 prompt to a prefill
engine. Nobody heartbeats that lease until a prefill engine tracks the turn-2
request, so until then the fixed TTL applies, as in stock.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvproto.config import LeaseConfig
from kvproto.ticket import PARAMS_KEY, LeaseMint, LeaseTicket

from .groups import TransferGroups, single_full_group
from .metadata import Grant

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvproto_connector.holder_scheduler")

TRUNCATED_KEY = "_p_side_truncated"
"""Stock's kv_transfer_params flag: this prefill was cut short by the backoff already."""

MODE_KEY = "kvproto_transfer_mode"
"""kv_transfer_params key: the transfer modes this holder serves (:data:`SERVED_MODES`), a
list; a decoder whose own mode is not in it prefills locally. Not stock's ``transfer_mode``
key: vllm-router 0.1.17 passes P's parameters to D unchanged unless that key says "push", and
then only stock push's few keys."""

SERVED_MODES: dict[str, tuple[str, ...]] = {"pull": ("pull",), "push": ("pull", "push")}
"""What a holder of each ``transfer_mode`` serves. A push engine runs the holder, the reader and
the writer (spec/push-mode.md section 7): a pull decoder's reads are served by the same holder
that keeps a push decoder's source blocks, so one push P serves a fleet of both kinds of D. A
pull engine runs no writer: it serves pull only."""

SIBLINGS_KEPT = 1024
"""Parents of parallel-sampling children whose ticket is remembered for their siblings."""

READERS_KEY = "kvproto_readers"
"""kv_transfer_params key: how many of a parent's children this engine answered with the
lease so far (vLLM forwards the last child's params, which then name them all). A
decoder's children reach its scheduler one message each; the count tells its reader how
many will read the lease, so the first child's done does not free it before the others
read (:meth:`kvproto.reader.Reader.track`)."""


@dataclass(slots=True)
class _Siblings:
    """A parent whose first child was granted a lease."""

    prompt: list[int]
    """The children's prompt (a later child with another prompt is not a sibling)."""
    params: dict[str, Any]
    """The first child's kv_transfer_params, which every later child answers with."""
    readers: int = 1
    """Children answered with them so far."""


def sampling_parent(request_id: str) -> str | None:
    """The parent id of a parallel-sampling child (vLLM names the children of a request
    with ``n > 1`` ``f"{index}_{parent_request_id}"``, parallel_sampling.py), else None."""
    index, sep, parent = request_id.partition("_")
    return parent if sep and parent and index.isdigit() else None


class HolderScheduler:
    """Ticket minting for one prefill engine."""

    def __init__(
        self,
        lease: LeaseConfig,
        *,
        engine_id: str,
        tp_size: int,
        host: str,
        port: int,
        stock_port: int | None = None,
        dcp_size: int = 1,
        pp_size: int = 1,
        groups: TransferGroups | None = None,
        transfer_mode: str = "pull",
    ) -> None:
        """``transfer_mode`` goes into every grant's ``kv_transfer_params``: a decoder
        running the other mode refuses the request (recomputes it)."""
        self.lease = lease
        self.transfer_mode = transfer_mode
        self.groups = groups if groups is not None else single_full_group()
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.host = host
        self.port = port
        self.stock_port = stock_port
        self.dcp_size = dcp_size
        self.pp_size = pp_size
        # 63 bits: fits msgpack uint64 and JSON numbers exactly.
        self.incarnation = secrets.randbits(63)
        self._mint = LeaseMint(
            engine=engine_id,
            incarnation=self.incarnation,
            tp_size=tp_size,
            params=lease.params,
            entropy=secrets.token_bytes,
        )
        self._grants: list[Grant] = []
        self.granted = 0
        """Leases granted since start (scheduler-side stat)."""
        self.granted_turn2 = 0
        """Of those, turn-2 leases on decoded blocks (bidirectional)."""
        self.shared_children = 0
        """Parallel-sampling children answered with a sibling's lease (their blocks freed
        at once)."""
        self._siblings: OrderedDict[str, _Siblings] = OrderedDict()
        """Parent id → its first child granted a lease."""
        self._prefills: list[str] = []
        self._dropped: list[str] = []
        self._prefilling: set[str] = set()
        """Push mode: requests to be decoded elsewhere, in the scheduler (a decoder may
        register for them before they finish: the workers are told of each one's entry
        and of its leaving without a grant)."""

    def on_new_request(self, request: Request) -> None:
        """Push mode: tell the workers a prefill for a decoder entered. Then stop a prefill
        ``groups.backoff`` prompt tokens short (SSM state: the decoder computes the last
        token from the state after N-1), once, as stock does
        (``_truncate_request_for_prefill``); nothing to do for attention-only models."""
        params = request.kv_transfer_params
        rid = request.request_id
        pushes = self.transfer_mode == "push" and params and params.get("do_remote_decode")
        if pushes and rid not in self._prefilling:
            self._prefilling.add(rid)
            self._prefills.append(rid)
        backoff = self.groups.backoff
        if (
            not backoff
            or params is None
            or not params.get("do_remote_decode")
            or params.get(TRUNCATED_KEY)  # preempted and rescheduled: cut once
            or request.num_prompt_tokens <= backoff
            # Prompt logprobs skip the prefix cache: the decoder recomputes everything.
            or request.get_skip_reading_prefix_cache()
        ):
            return
        if request.prompt_token_ids is not None:
            del request.prompt_token_ids[-backoff:]
        elif request.prompt_embeds is not None:
            request.prompt_embeds = request.prompt_embeds[:-backoff]
        else:
            return
        del request._all_token_ids[-backoff:]
        request.num_prompt_tokens -= backoff
        request.max_tokens = 1
        params[TRUNCATED_KEY] = True

    def request_finished(
        self, request: Request, block_ids: Sequence[Sequence[int]], *, turn2: bool = False
    ) -> tuple[bool, dict[str, Any] | None]:
        """Grant and delay the free, or (False, None) when nothing will be read.

        ``turn2``: the request was decoded here and its blocks are kept for the
        conversation's next turn (D side of bidirectional transfer)."""
        granted, params = self._finish(request, block_ids, turn2=turn2)
        if request.request_id in self._prefilling:
            self._prefilling.discard(request.request_id)
            if not granted:
                self._dropped.append(request.request_id)
        return granted, params

    def _finish(
        self, request: Request, block_ids: Sequence[Sequence[int]], *, turn2: bool
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None  # aborted or errored during prefill: nothing to hand over
        # One list per transfer group, clipped to what a reader takes (a window's tail,
        # an SSM state block): one lease covers every group's blocks.
        groups = self.groups.clip(block_ids)
        if not any(groups):
            return False, None
        parent = None if turn2 else sampling_parent(request.request_id)
        prompt = request.prompt_token_ids
        if parent is not None and prompt is not None:
            shared = self._siblings.get(parent)
            if shared is not None and shared.prompt == prompt:
                # Children of one request (n > 1) carry the same prompt, and vLLM hands
                # the decoder one child's kv_transfer_params only (the last to finish):
                # every child names the first one's lease, so the decoder's children all
                # read that one copy, and this child's blocks go back now instead of
                # waiting under a lease nobody claims.
                self.shared_children += 1
                shared.readers += 1
                return False, {**shared.params, READERS_KEY: shared.readers}
        # Turn 1: the claim window (a dropped request frees then); turn 2: the client's TTL.
        ttl = self.lease.decoder_kv_blocks_ttl if turn2 else self.lease.grant_ttl
        ticket = self._mint.mint(time.monotonic(), request_id=request.request_id, ttl=ttl)
        self._grants.append(Grant(request_id=request.request_id, ticket=ticket, block_ids=groups))
        self.granted += 1
        if turn2:
            self.granted_turn2 += 1
        params: dict[str, Any] = {
            "do_remote_prefill": not turn2,
            "do_remote_decode": turn2,
            "remote_block_ids": groups,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.host,
            # A stock decoder handshakes on remote_port: in interop mode that is the
            # stock-format listener, and kvproto decoders use kvproto_side_channel_port.
            "remote_port": self.port if self.stock_port is None else self.stock_port,
            "kvproto_side_channel_port": self.port,
            "tp_size": self.tp_size,
            "dcp_size": self.dcp_size,
            "pp_size": self.pp_size,
            "remote_num_tokens": int(request.num_computed_tokens),
            # A reader whose blocks are a multiple of ours reads each of ours into a part.
            "remote_block_size": self.groups.block_size,
            # Stock's absolute turn-2 deadline (this host's monotonic clock), for proxies
            # that look at it; kvproto readers judge the ticket instead.
            "remote_blocks_expiry_time": ticket.deadline if turn2 else None,
            MODE_KEY: list(SERVED_MODES[self.transfer_mode]),
            PARAMS_KEY: ticket.to_params(),
        }
        if self.transfer_mode == "pull":
            # Stock's key, pull only: given "push", vllm-router 0.1.17 hands D stock push's
            # few keys (no block ids, no ticket) instead of P's parameters as they are.
            params["transfer_mode"] = "pull"
        if parent is not None and prompt is not None:
            params[READERS_KEY] = 1
            self._siblings[parent] = _Siblings(list(prompt), dict(params))
            if len(self._siblings) > SIBLINGS_KEPT:
                self._siblings.popitem(last=False)
        return True, params

    def grant_writable(self, request_id: str) -> LeaseTicket:
        """Push mode, D: a lease on ``request_id``'s freshly allocated blocks for the prefill
        engine that writes them; unclaimed, it lives the claim window (``grant_ttl``)."""
        ticket = self._mint.mint(time.monotonic(), request_id=request_id, ttl=self.lease.grant_ttl)
        self._grants.append(Grant(request_id=request_id, ticket=ticket, writable=True))
        self.granted += 1
        return ticket

    def take_grants(self) -> list[Grant]:
        """Grants made since the last call (for this step's metadata)."""
        out, self._grants = self._grants, []
        return out

    def take_prefills(self) -> tuple[list[str], list[str]]:
        """Push mode: (prefills that entered, prefills that left without a grant) since the
        last call (for this step's metadata)."""
        out = (self._prefills, self._dropped)
        self._prefills, self._dropped = [], []
        return out
