"""D, scheduler side: track a request's lease from enqueue, plan its read, stop tracking.

* ``on_new_request`` (right after enqueue, before any scheduling): a request
  with ``do_remote_prefill`` and a valid kvproto ticket is tracked, and the
  worker is told to start heartbeating for it at the next step -- whether or
  not the scheduler has room for it yet. A request without a usable ticket
  (stock prefill engine, malformed or expired ticket) is not tracked and is
  prefilled locally.
* ``get_num_new_matched_tokens`` / ``update_state_after_alloc``: like stock,
  load the prompt tokens not computed locally (a partial prefix hit reads
  only the tail), asynchronously.
* ``request_finished`` (finished or aborted) and ``update_connector_output``
  (``finished_recving``): tell the worker to stop tracking; a request aborted
  before its read started aborts the lease, so the holder frees at once.

Push mode, registered early: a request that carries its prefill engine's address but no
ticket (a proxy sent it to the prefill engine and here at once) is not tracked -- there is
no prefill lease yet -- but registered: at ``update_state_after_alloc`` this engine grants
the writable lease on the allocated blocks and names them per KV cache group; the prefill
engine pairs them with its own blocks when it finishes (spec/push-mode.md §7).

Bidirectional turn 2 (P side): a request with ``do_remote_decode`` that also
carries a decoder's ``remote_block_ids``, address and ticket is the next turn
of a conversation whose KV the decoder kept. It is tracked the same way (the
reader claims and heartbeats D's lease from enqueue), loads
``min(remote_num_tokens, prompt) - local hits`` tokens, and plans its read
once (stock's ``_remote_blocks_processed`` flag); ``do_remote_decode`` stays
set, so the finished prefill is granted to a decoder as usual.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvproto.errors import RemoteProtocolError
from kvproto.ticket import PARAMS_KEY, LeaseTicket

from .groups import (
    NULL_BLOCK,
    SSM,
    BlockPairs,
    TransferGroups,
    block_ratio,
    last_parts,
    plan_pairs,
    single_full_group,
)
from .holder_scheduler import MODE_KEY, READERS_KEY
from .metadata import EarlyRegistration, Recv, Track

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvproto_connector.reader_scheduler")

ABORT_LINGER_S = 1.0
"""How long the engine keeps stepping after a tracked request left before it was read.

vLLM steps an engine only while it has requests; an aborted request's last
step ships its finish, but if its holder session was still being opened the
abort leaves only once the Welcome arrives. Without more steps the holder
would keep the blocks until the lease lapses (vLLM #41269's symptom)."""


TURN2_DONE_KEY = "_remote_blocks_processed"
"""Stock's kv_transfer_params flag: the turn-2 read of this request was planned."""


@dataclass(slots=True)
class _Early:
    """A push request whose prefill engine has not finished (no ticket yet)."""

    engine: str
    host: str
    port: int
    tp_size: int
    planned: bool = False


@dataclass(slots=True)
class _Tracked:
    ticket: LeaseTicket
    remote_block_ids: list[list[int]]
    """The holder's blocks, one list per transfer group (clipped by the holder)."""
    remote_num_tokens: int | None
    holder_block_size: int
    """The holder's tokens per block (``remote_block_size``; ours if it names none)."""
    ratio: int = 1
    """Holder blocks per local block (:func:`.groups.block_ratio`)."""
    turn2: bool = False
    planned: bool = False


class ReaderScheduler:
    """Request tracking and read planning for one decode engine."""

    def __init__(
        self,
        *,
        recompute_threshold: int = 0,
        bidirectional: bool = False,
        groups: TransferGroups | None = None,
        tp_size: int = 1,
        transfer_mode: str = "pull",
        mint_writable: Callable[[str], LeaseTicket] | None = None,
    ) -> None:
        """``transfer_mode``: what this engine runs; a request whose holder names the other
        mode is recomputed. ``mint_writable`` (push mode): grants the lease on a request's
        allocated blocks that its prefill engine writes (registered instead of read)."""
        self._mode = transfer_mode
        self._mint_writable = mint_writable
        self._groups = groups if groups is not None else single_full_group()
        self._tp_size = tp_size
        self._threshold = recompute_threshold
        self._bidirectional = bidirectional
        self._tracked: dict[str, _Tracked] = {}
        self._early: dict[str, _Early] = {}
        """Push mode: requests registered before their prefill finished (no ticket yet)."""
        self._tracks: list[Track] = []
        self._recvs: list[Recv] = []
        self._finishes: list[str] = []
        self.untracked = 0
        """Requests with do_remote_prefill that could not be tracked (recomputed)."""
        self._linger_until = 0.0

    # ------------------------------------------------------------ hooks

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        turn2 = self._is_turn2(params)
        if not turn2 and not params.get("do_remote_prefill"):
            return
        rid = request.request_id
        if rid in self._tracked or rid in self._early:
            return  # vLLM calls this once per request; be safe on a re-add
        if not turn2 and self._mint_writable is not None and PARAMS_KEY not in params:
            # Push, registered before its prefill finished (no ticket yet).
            early = _parse_early(params, self._groups, self._tp_size)
            if isinstance(early, str):
                self._prefill_locally(rid, params, early, turn2=False)
            else:
                self._early[rid] = early
            return
        parsed = _parse(params, self._groups, self._tp_size, self._mode)
        if isinstance(parsed, str):
            self._prefill_locally(rid, params, parsed, turn2=turn2)
            return
        ticket, host, port, remote_blocks, remote_tokens, holder_block, ratio = parsed
        self._tracked[rid] = _Tracked(
            ticket, remote_blocks, remote_tokens, holder_block, ratio=ratio, turn2=turn2
        )
        self._tracks.append(
            Track(request_id=rid, ticket=ticket, host=host, port=port, readers=_readers(params))
        )

    def _prefill_locally(self, rid: str, params: dict[str, Any], why: str, *, turn2: bool) -> None:
        """Leave the request untracked, to be prefilled here, with the reason logged."""
        self.untracked += 1
        what = "the turn-2 prefix of request" if turn2 else "request"
        log.warning("%s %s is prefilled locally: %s", what, rid, why)
        params["do_remote_prefill"] = False
        if turn2:
            params[TURN2_DONE_KEY] = True

    def _is_turn2(self, params: dict[str, Any]) -> bool:
        """A turn-2 prefill that can read the decoder's kept blocks (stock's test)."""
        return (
            self._bidirectional
            and bool(params.get("do_remote_decode"))
            and bool(params.get("remote_block_ids"))
            and not params.get(TURN2_DONE_KEY)
        )

    def _wanted(self, request: Request) -> _Tracked | None:
        """The tracked entry of a request whose read is not planned yet."""
        tracked = self._tracked.get(request.request_id)
        params = request.kv_transfer_params
        if tracked is None or not params:
            return None
        if tracked.turn2:
            return None if params.get(TURN2_DONE_KEY) else tracked
        return tracked if params.get("do_remote_prefill") else None

    def _early_wanted(self, request: Request) -> _Early | None:
        """The early registration of a request whose blocks are not allocated yet."""
        early = self._early.get(request.request_id)
        params = request.kv_transfer_params
        if early is None or early.planned or not params or not params.get("do_remote_prefill"):
            return None
        return early

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if self._early_wanted(request) is not None:
            # The prefill engine computes the whole prompt (an SSM state: all but the last).
            available = self._groups.tokens_to_load(int(request.num_prompt_tokens))
        else:
            tracked = self._wanted(request)
            if tracked is None:
                return 0, False
            available = self._available(tracked, request)
        count = available - num_computed_tokens
        if count <= 0 or count < self._threshold:
            return 0, False  # nothing worth reading: update_state_after_alloc frees P at once
        return count, True

    def _available(self, tracked: _Tracked, request: Request) -> int:
        """Prompt tokens whose KV the holder has for this request (local hits included)."""
        available = int(request.num_prompt_tokens)
        if not tracked.turn2:
            # An SSM state is the state after the holder's N-1 tokens: load as many.
            available = self._groups.tokens_to_load(available)
        if tracked.remote_num_tokens is not None:
            available = min(available, tracked.remote_num_tokens)
        elif tracked.turn2:
            available = 0  # stock: a turn-2 holder that names no token count gives none
        return available

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        early = self._early_wanted(request)
        if early is not None:
            self._register_early(request, early, blocks, num_external_tokens)
            return
        tracked = self._wanted(request)
        params = request.kv_transfer_params
        if tracked is None or params is None:
            return
        local: list[list[int]] = [[] for _ in tracked.remote_block_ids]
        allocated: list[int] = []
        ratio, tail_parts, holder_blocks = tracked.ratio, 1, 0
        if num_external_tokens > 0:
            local = self._groups.clip(blocks.get_unhashed_block_ids_all_groups())
            allocated = self._allocated(blocks)
            if ratio > 1:  # (an SSM-only engine has no block size: ratio 1)
                tokens = self._available(tracked, request)
                holder_blocks = -(-tokens // tracked.holder_block_size)
                tail_parts = last_parts(tokens, tracked.holder_block_size, ratio)
        problem = None
        try:
            pairs = plan_pairs(
                self._groups,
                local,
                tracked.remote_block_ids,
                allocated,
                ratio=ratio,
                tail_parts=tail_parts,
                holder_blocks=holder_blocks,
            )
        except ValueError as exc:
            # Nothing is read; every local block is reported bad, so vLLM recomputes.
            problem = f"{exc}; recomputing"
            log.error("request %s: %s", request.request_id, problem)
            pairs = BlockPairs(local=[b for group in local for b in group], remote=[], parts=[])
        writable = None
        if self._mint_writable is not None and num_external_tokens > 0 and problem is None:
            writable = self._mint_writable(request.request_id)  # push: registered, not read
        tracked.planned = True
        self._recvs.append(
            Recv(
                request_id=request.request_id,
                local_block_ids=pairs.local,
                remote_block_ids=pairs.remote,
                awaiting=num_external_tokens > 0,
                problem=problem,
                local_parts=pairs.parts,
                ratio=pairs.ratio,
                filled_block_ids=pairs.filled,
                writable=writable,
            )
        )
        # One transfer per request, as stock (a turn-2 request keeps do_remote_decode).
        params["do_remote_prefill"] = False
        if tracked.turn2:
            params[TURN2_DONE_KEY] = True

    def _register_early(
        self, request: Request, early: _Early, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Grant the writable lease on the allocated blocks and name them per group; the
        prefill engine pairs them with its own. A full local hit registers nothing (the
        prefill engine's unclaimed lease then lapses after its claim window)."""
        params = request.kv_transfer_params
        assert params is not None and self._mint_writable is not None
        early.planned = True
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            return
        local = self._groups.clip(blocks.get_unhashed_block_ids_all_groups())
        self._recvs.append(
            Recv(
                request_id=request.request_id,
                local_block_ids=[b for group in local for b in group if b != NULL_BLOCK],
                remote_block_ids=[],
                awaiting=True,
                writable=self._mint_writable(request.request_id),
                early=EarlyRegistration(
                    engine=early.engine,
                    host=early.host,
                    port=early.port,
                    tp_size=early.tp_size,
                    local_groups=local,
                    allocated=self._allocated(blocks),
                    block_size=self._groups.block_size,
                ),
            )
        )

    def _allocated(self, blocks: KVCacheBlocks) -> list[int]:
        """Per transfer group, the blocks allocated to the request (hits included)."""
        allocated = blocks.get_block_ids()
        return [
            len(allocated[gid]) if gid < len(allocated) else 0 for gid in self._groups.group_ids
        ]

    def request_finished(self, request: Request) -> None:
        tracked = self._tracked.pop(request.request_id, None)
        early = self._early.pop(request.request_id, None)
        if tracked is not None or (early is not None and early.planned):
            self._finishes.append(request.request_id)
            self._linger_until = time.monotonic() + ABORT_LINGER_S

    def has_pending_work(self) -> bool:
        """Keep stepping briefly so a just-finished request's abort reaches its holder."""
        return bool(self._finishes) or time.monotonic() < self._linger_until

    def finished_recving(self, request_ids: set[str] | None) -> None:
        for rid in request_ids or ():
            early = self._early.pop(rid, None)
            if self._tracked.pop(rid, None) is not None or early is not None:
                self._finishes.append(rid)

    # ------------------------------------------------------------ metadata

    def take(self) -> tuple[list[Track], list[Recv], list[str]]:
        """This step's orders for the worker; clears them."""
        out = (self._tracks, self._recvs, self._finishes)
        self._tracks, self._recvs, self._finishes = [], [], []
        return out

    def is_tracked(self, request_id: str) -> bool:
        """Whether a request is tracked, or registered early (for tests)."""
        return request_id in self._tracked or request_id in self._early

    def tracked_count(self) -> int:
        """Requests tracked now."""
        return len(self._tracked)


def _parse(
    params: dict[str, Any], groups: TransferGroups, tp_size: int, mode: str = "pull"
) -> tuple[LeaseTicket, str, int, list[list[int]], int | None, int, int] | str:
    """The ticket and addressing of a remote-prefill request, or why it is unusable."""
    raw_modes = params.get(MODE_KEY, ["pull"])
    served = _served_modes(raw_modes)
    if served is None:
        return f"malformed {MODE_KEY} {raw_modes!r} (a list of transfer modes)"
    if mode not in served:
        return (
            f"its prefill engine serves transfer_mode {' and '.join(served)}, this engine "
            f"runs {mode!r}; set transfer_mode 'push' on the prefill engine (a push engine "
            "serves pull decoders too) or the same transfer_mode on both engines"
        )
    raw = params.get(PARAMS_KEY)
    if raw is None:
        return "no kvproto lease ticket in kv_transfer_params (a stock prefill engine?)"
    try:
        ticket = LeaseTicket.from_params(raw)
    except RemoteProtocolError as exc:
        return f"unusable lease ticket: {exc}"
    host = params.get("remote_host")
    port = params.get("kvproto_side_channel_port", params.get("remote_port"))
    if not isinstance(host, str) or not host:
        return "remote_host missing"
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return f"bad remote_port {port!r}"
    if params.get("remote_engine_id") not in (None, ticket.holder_engine):
        return "remote_engine_id does not match the ticket's holder engine"
    blocks = _block_ids(params.get("remote_block_ids"))
    if blocks is None:
        return "remote_block_ids missing or malformed"
    if len(blocks) != len(groups.kinds):
        return (
            f"the holder sent {len(blocks)} KV cache group(s), this engine has "
            f"{len(groups.kinds)} ({groups.describe()})"
        )
    tp_problem = groups.hetero_tp_problem(tp_size, ticket.holder_tp_size)
    if tp_problem is not None:
        return f"cannot read {tp_problem}"
    tokens = params.get("remote_num_tokens")
    remote_tokens = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None
    holder_block = params.get("remote_block_size", groups.block_size)
    if isinstance(holder_block, bool) or not isinstance(holder_block, int):
        return f"bad remote_block_size {holder_block!r}"
    ratio = block_ratio(groups.block_size, holder_block) if groups.block_size else 1
    if isinstance(ratio, str):
        return ratio
    if ratio > 1 and (groups.packed or SSM in groups.kinds):
        return (
            f"blocks of {holder_block} tokens (holder) and {groups.block_size} (here) with "
            f"{groups.describe()} KV: unequal block sizes are read for attention groups "
            "only (an SSM state is one indivisible block)"
        )
    return ticket, host, port, blocks, remote_tokens, holder_block, ratio


def _parse_early(params: dict[str, Any], groups: TransferGroups, tp_size: int) -> _Early | str:
    """Where the prefill engine of an early push registration is, or why not usable."""
    served = _served_modes(params.get(MODE_KEY))
    if served is None or "push" not in served:
        return (
            f"no kvproto lease ticket, and {MODE_KEY} {params.get(MODE_KEY)!r} does not say "
            "the prefill engine writes (a proxy that sends the request to both engines at "
            "once gives the prefill engine's modes, address, engine id and tp_size)"
        )
    engine, host = params.get("remote_engine_id"), params.get("remote_host")
    port = params.get("kvproto_side_channel_port", params.get("remote_port"))
    p_tp = params.get("tp_size")
    if not isinstance(engine, str) or not engine:
        return "remote_engine_id missing"
    if not isinstance(host, str) or not host:
        return "remote_host missing"
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return f"bad remote_port {port!r}"
    if isinstance(p_tp, bool) or not isinstance(p_tp, int) or p_tp < 1:
        return f"bad tp_size {p_tp!r}"
    if max(p_tp, tp_size) % min(p_tp, tp_size):
        return f"TP sizes {p_tp} (prefill) and {tp_size} (here) do not divide"
    tp_problem = groups.hetero_tp_problem(tp_size, p_tp)
    if tp_problem is not None:
        return f"cannot write {tp_problem}"
    block = params.get("remote_block_size", groups.block_size)
    if block != groups.block_size:
        return (
            f"blocks of {block!r} tokens (prefill) and {groups.block_size} (here): a "
            "registration before the prefill finished pairs equal blocks only"
        )
    return _Early(engine=engine, host=host, port=port, tp_size=p_tp)


def _served_modes(raw: object) -> list[str] | None:
    """The holder's served modes from ``kv_transfer_params``, or None when malformed."""
    if not isinstance(raw, list) or not raw or not all(isinstance(m, str) for m in raw):
        return None
    return [str(m) for m in raw]


def _readers(params: dict[str, Any]) -> int:
    """The holder's count of requests reading the ticket (1 when it names none or a bad
    one: a wrong count only delays or brings forward the lease's done, its verdict still
    fences every read)."""
    value = params.get(READERS_KEY)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


def _block_ids(value: Any) -> list[list[int]] | None:
    """Stock's one list per KV cache group; a flat list is one group."""
    if not isinstance(value, list | tuple) or not value:
        return None
    groups = value if isinstance(value[0], list | tuple) else [value]
    out = []
    for group in groups:
        if not isinstance(group, list | tuple) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in group
        ):
            return None
        out.append([int(b) for b in group])
    return out
