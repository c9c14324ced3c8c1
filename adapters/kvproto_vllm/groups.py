"""Which of a request's KV cache groups cross the wire, and how their blocks pair up.

vLLM's hybrid allocator gives a model one KV cache *group* per kind of layer
(full attention, sliding window, SSM state, ...); a request then owns one block
list per group, all drawn from one block pool, and every group's layers alias
the same backing memory from byte 0 (``allocate_kv_cache``): a block id names
the same bytes whichever group owns it. So one lease covers a request's blocks
of every group, and one READ of every registered region at the paired block
ids moves every group's KV (the worker's layout, ``kv_layout.py``).

What is paired follows stock NixlConnector (``base_scheduler.py``,
``get_exchange_clipped_blocks``; ``base_worker.py``, ``_apply_prefix_caching``):

* only the *transfer* groups (``KVCacheConfig.transfer_groups``) travel;
* a sliding-window group keeps its in-window tail, ``cdiv(window, block) + 1``
  blocks (the allocator keeps blocks for the whole sequence until the request
  finishes, then nulls the rest);
* an SSM group keeps its state-bearing block (vLLM's ``clip_ssm_state_blocks``);
* per group, the decoder's blocks to fill pair with the tail of the holder's
  list (a partial prefix hit fills only the tail), pairs with vLLM's null
  block (id 0) on either side are dropped: nothing is read into or out of it.

An SSM state is the state after the last computed token, so it cannot be
"re-run" for the token the decoder computes itself: with SSM layers the prefill
engine stops one prompt token short (:attr:`TransferGroups.backoff`) and the
decoder loads one token less, exactly as stock does (``_prefill_backoff``).

Pure apart from reading vLLM's config objects: unit-testable without an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

NULL_BLOCK = 0
"""vLLM's null block (``BlockPool.null_block``): a placeholder no data lives in."""

FULL = "full"
SLIDING_WINDOW = "sliding_window"
SSM = "ssm"
"""Group kinds this module transfers (:attr:`TransferGroups.kinds`)."""


class UnsupportedShape(ValueError):
    """The model's KV cache has a shape KvprotoConnector does not transfer; the message
    names the shape and what to set instead (raised when the engine starts)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferGroups:
    """How one engine's KV cache groups are exchanged (built once, from vLLM's config)."""

    kinds: tuple[str, ...]
    """Per transfer group: :data:`FULL`, :data:`SLIDING_WINDOW` or :data:`SSM`."""
    group_ids: tuple[int, ...]
    """Index of each transfer group in ``KVCacheConfig.kv_cache_groups``."""
    num_groups: int
    """How many groups the engine has in all (``request_finished``'s tuple length)."""
    window_blocks: tuple[int, ...]
    """Per transfer group: blocks kept of a sliding-window group's tail, 0 = all."""
    ssm_spec_blocks: tuple[int, ...]
    """Per transfer group: an SSM group's trailing speculative scratch blocks (else 0)."""
    block_size: int
    """Tokens per attention block (every attention group's; 0 for an SSM-only model)."""
    packed: bool = False
    """Blocks are block-outermost (every layer's page of a block side by side): a block
    is then not one layer's head-major page, and cannot be split by heads."""
    mla: bool = False
    """Latent attention (MLA): every TP rank keeps the whole KV (read from one rank)."""

    def hetero_tp_problem(self, local_tp: int, holder_tp: int) -> str | None:
        """Why a pair of these TP sizes cannot be read, or None if it can.

        Split KV is read by head slices of layer pages; an SSM state is split across
        ranks along its channels (stock's conv split, not implemented here) and a packed
        block holds every layer's page, so neither slices by heads. MLA reads whole."""
        if local_tp == holder_tp or self.mla:
            return None
        if SSM in self.kinds:
            return f"SSM state across TP {holder_tp} -> {local_tp} (equal TP sizes only)"
        if self.packed:
            return f"block-outermost KV across TP {holder_tp} -> {local_tp} (equal TP only)"
        return None

    @property
    def backoff(self) -> int:
        """Trailing prompt tokens the prefill engine does not compute and the decoder
        recomputes: 1 with SSM layers (their state is the state after N-1 tokens)."""
        return 1 if SSM in self.kinds else 0

    @property
    def hybrid(self) -> bool:
        """More than one group, or any group that is not full attention."""
        return len(self.kinds) > 1 or any(kind != FULL for kind in self.kinds)

    def describe(self) -> str:
        """``"full+sliding_window(5 blocks)"`` and the like: logs and the compat factors."""
        parts = []
        for kind, window, spec in zip(
            self.kinds, self.window_blocks, self.ssm_spec_blocks, strict=True
        ):
            if kind == SLIDING_WINDOW:
                parts.append(f"{kind}({window} blocks)")
            elif kind == SSM and spec:
                parts.append(f"{kind}(+{spec} spec)")
            else:
                parts.append(kind)
        return "+".join(parts)

    def clip(self, block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """The transfer groups' blocks of one request, clipped to what is exchanged.

        ``block_ids`` has one list per engine group (vLLM's tuple); an empty tuple (a
        full prefix hit) gives one empty list per transfer group."""
        if not block_ids:
            return [[] for _ in self.kinds]
        if len(block_ids) != self.num_groups:
            raise ValueError(f"{len(block_ids)} block lists for {self.num_groups} KV cache groups")
        out = []
        for gid, kind, window, spec in zip(
            self.group_ids, self.kinds, self.window_blocks, self.ssm_spec_blocks, strict=True
        ):
            blocks = [int(b) for b in block_ids[gid]]
            if kind == SLIDING_WINDOW and window:
                blocks = blocks[-window:]
            elif kind == SSM and blocks:
                blocks = clip_ssm_state(blocks, spec)
            out.append(blocks)
        return out

    def tokens_to_load(self, prompt_tokens: int) -> int:
        """Prompt tokens the decoder loads of a prompt of ``prompt_tokens`` (stock's
        ``_get_remote_prefill_token_count``)."""
        backoff = self.backoff
        return prompt_tokens - backoff if backoff and prompt_tokens > backoff else prompt_tokens


def block_outermost(tensor: Any) -> bool:
    """Whether a ``KVCacheTensor`` packs every layer's page of a block side by side
    (layer-outermost placement has ``layer_stride = page * num_blocks >= block_stride``)."""
    return int(tensor.block_stride) > int(tensor.layer_stride)


def single_full_group(block_size: int = 0) -> TransferGroups:
    """One full-attention group: what an engine without a hybrid allocator has."""
    return TransferGroups(
        kinds=(FULL,),
        group_ids=(0,),
        num_groups=1,
        window_blocks=(0,),
        ssm_spec_blocks=(0,),
        block_size=block_size,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockPairs:
    """One request's read plan over every group: holder block ``remote[i]`` fills part
    ``parts[i]`` of ``ratio`` of local block ``local[i]`` (the whole block at ratio 1)."""

    local: list[int]
    """Local block per pair (repeated for its parts when ``ratio > 1``)."""
    remote: list[int]
    """Holder block per pair."""
    parts: list[int]
    """Per pair, which part of the local block; empty at ratio 1."""
    ratio: int = 1
    """Holder blocks per local block (the decoder's block size over the holder's)."""
    filled: list[int] = field(default_factory=list)
    """Local blocks the read writes into, once each (every part not read is zeroed)."""


def block_ratio(local_block_size: int, holder_block_size: int) -> int | str:
    """Holder blocks per local block, or why the pair cannot be read.

    A reader's block must be a whole number of holder blocks (stock NixlConnector's
    ``block_size_ratio``): each holder block then fills one part of a local block, in
    token order. A holder with larger blocks would have to be read in parts of its
    head-major pages, which are not token ranges."""
    if holder_block_size <= 0 or local_block_size <= 0:
        return f"bad block sizes {holder_block_size} (holder) and {local_block_size} (local)"
    if local_block_size % holder_block_size:
        return (
            f"the holder's block size {holder_block_size} does not divide this engine's "
            f"{local_block_size} (a reader's blocks must be a multiple of the holder's)"
        )
    return local_block_size // holder_block_size


def last_parts(tokens: int, holder_block_size: int, ratio: int) -> int:
    """Parts of a request's last local block that hold any of its ``tokens`` (1..ratio)."""
    holder_blocks = -(-tokens // holder_block_size)
    return holder_blocks - (-(-holder_blocks // ratio) - 1) * ratio if tokens > 0 else ratio


def pair_blocks(
    local: Sequence[Sequence[int]],
    remote: Sequence[Sequence[int]],
    *,
    ratio: int = 1,
    tail_parts: int = 1,
    windowed: Sequence[bool] = (),
) -> BlockPairs:
    """Local and holder block ids of one READ over every group, pair by pair.

    Per group both lists end at the block holding the last token read: the local
    blocks to fill (its parts, ``ratio`` per block, but only ``tail_parts`` of the last
    one) take the tail of the holder's list (a partial prefix hit fills only the tail).
    A group with more to fill than the holder has cannot be filled (ValueError: the
    request is recomputed) unless it is ``windowed``: a sliding window's tail counted in
    larger local blocks reaches further back than the holder's, and those leading parts
    are out of the window (they are zeroed). Pairs with the null block on either side
    are dropped."""
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local groups, the holder sent {len(remote)}")
    if ratio < 1 or not 1 <= tail_parts <= ratio:
        raise ValueError(f"bad block ratio {ratio} with {tail_parts} parts in the last block")
    out = BlockPairs(local=[], remote=[], parts=[], ratio=ratio)
    for group, (mine, theirs) in enumerate(zip(local, remote, strict=True)):
        if not mine:
            continue
        subs = [(int(b), part) for b in mine for part in range(ratio)]
        del subs[len(subs) - (ratio - tail_parts) :]
        if len(subs) > len(theirs):
            if not (ratio > 1 and group < len(windowed) and windowed[group]):
                what = "local blocks" if ratio == 1 else f"local block parts (of {ratio})"
                raise ValueError(
                    f"group {group}: {len(subs)} {what} to fill, the holder has {len(theirs)}"
                )
            subs = subs[len(subs) - len(theirs) :]
        for (lb, part), rb in zip(subs, theirs[len(theirs) - len(subs) :], strict=True):
            if NULL_BLOCK not in (lb, rb):
                out.local.append(lb)
                out.remote.append(int(rb))
                if ratio > 1:
                    out.parts.append(part)
        if ratio > 1:
            out.filled.extend(b for b in dict.fromkeys(int(b) for b in mine) if b != NULL_BLOCK)
    return out


def plan_pairs(
    groups: TransferGroups,
    local: Sequence[Sequence[int]],
    remote: Sequence[Sequence[int]],
    allocated: Sequence[int],
    *,
    ratio: int = 1,
    tail_parts: int = 1,
    holder_blocks: int = 0,
) -> BlockPairs:
    """:func:`pair_blocks` of one request, the holder's lists trimmed first: the holder's
    blocks may cover more tokens than the request loads (it decoded past the prompt, or a
    turn-2 prompt is shorter than D's whole conversation). Its block i holds the tokens of
    our block i // ratio, and a transfer takes the tail of the holder's list, so it must end
    where ours ends. ``allocated``: per transfer group, the blocks allocated to the request
    here (hits included); ``holder_blocks``: at ``ratio > 1``, the holder blocks its tokens
    fill. Raises ValueError when the holder's blocks do not cover ours."""
    trimmed = [list(group) for group in remote]
    for index, kind in enumerate(groups.kinds):
        n_alloc = allocated[index] if index < len(allocated) else 0
        if index >= len(trimmed) or kind != FULL or not n_alloc:
            continue
        if ratio == 1 and n_alloc < len(trimmed[index]):
            trimmed[index] = trimmed[index][:n_alloc]
        elif ratio > 1:
            trimmed[index] = trimmed[index][:holder_blocks]
    windowed = [kind == SLIDING_WINDOW for kind in groups.kinds]
    return pair_blocks(local, trimmed, ratio=ratio, tail_parts=tail_parts, windowed=windowed)


def clip_ssm_state(blocks: list[int], spec_blocks: int) -> list[int]:
    """An SSM group's running-state block: the speculative scratch blocks trail it and
    superseded states or null placeholders lead it (vLLM's ``clip_ssm_state_blocks``,
    ``kv_connector/utils.py``, the rule stock exchanges by)."""
    if not blocks:
        return blocks
    scratch = min(spec_blocks, len(blocks) - 1)
    return blocks[: len(blocks) - scratch][-1:]


def transfer_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> TransferGroups:
    """The engine's :class:`TransferGroups`, or :class:`UnsupportedShape` naming why not."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    groups = list(kv_cache_config.kv_cache_groups)
    ids: tuple[int, ...] = tuple(getattr(kv_cache_config, "transfer_group_ids", range(len(groups))))
    if not ids:
        raise UnsupportedShape("the model has no KV cache group to transfer (attention-free?)")
    kinds, windows, specs, sizes = [], [], [], set()
    for gid in ids:
        spec: Any = groups[gid].kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            layer_specs = list(spec.kv_cache_specs.values())
            spec = layer_specs[0]
            if any(type(s) is not type(spec) for s in layer_specs):
                raise UnsupportedShape(_refusal(f"group {gid} mixes {_names(layer_specs)}"))
        if not isinstance(spec, MambaSpec):  # an SSM "block" spans the whole sequence
            sizes.add(int(spec.block_size))
        # SlidingWindowMLASpec is a SlidingWindowSpec: read as a window (MLA changes only
        # the TP split, which the reader's replicated_kv handles).
        if isinstance(spec, SlidingWindowSpec):
            kinds.append(SLIDING_WINDOW)
            windows.append(-(-int(spec.sliding_window) // int(spec.block_size)) + 1)
            specs.append(0)
        elif isinstance(spec, MambaSpec):
            kinds.append(SSM)
            windows.append(0)
            specs.append(int(getattr(spec, "num_speculative_blocks", 0)))
        elif type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            # Exactly these two: a subclass (sinks, hidden-state caches, ...) keeps more
            # than a block's KV, so it is refused below rather than half transferred.
            kinds.append(FULL)
            windows.append(0)
            specs.append(0)
        else:
            raise UnsupportedShape(_refusal(f"group {gid} is {type(spec).__name__}"))
    if len(sizes) > 1:
        raise UnsupportedShape(_refusal(f"groups with different block sizes {sorted(sizes)}"))
    packed = any(
        block_outermost(t)
        for t in getattr(kv_cache_config, "kv_cache_tensors", ())
        if hasattr(t, "block_stride")
    )
    model = vllm_config.model_config
    lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 1) or 1)
    if lookahead > 1:
        raise UnsupportedShape(
            "KvprotoConnector does not transfer models whose prefill looks ahead "
            f"({lookahead} tokens: multi-module MTP); run without speculative decoding "
            "or use NixlConnector"
        )
    return TransferGroups(
        kinds=tuple(kinds),
        group_ids=ids,
        num_groups=len(groups),
        window_blocks=tuple(windows),
        ssm_spec_blocks=tuple(specs),
        block_size=sizes.pop() if sizes else 0,
        packed=packed,
        mla=bool(model is not None and model.use_mla),
    )


def _names(specs: Sequence[object]) -> str:
    return ", ".join(sorted({type(s).__name__ for s in specs}))


def _refusal(what: str) -> str:
    return (
        f"KvprotoConnector cannot transfer this model's KV cache: {what}. It transfers "
        "full-attention, sliding-window, MLA and SSM (Mamba) groups of one block size; "
        "use NixlConnector for this model, or disable the hybrid allocator "
        "(--disable-hybrid-kv-cache-manager) if the model allows it"
    )
