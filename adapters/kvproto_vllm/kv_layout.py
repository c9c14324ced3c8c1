"""The registered memory of an engine's KV cache: regions x blocks, for every group at once.

vLLM 0.32 allocates the whole KV cache as one backing buffer and describes
where each layer's page of each block lives with ``KVCacheTensor``
(``offset + l * layer_stride + b * block_stride``; ``allocate_kv_cache``).
Two placements exist:

* **layer-outermost** (uniform page sizes; every model before hybrid SSM):
  each layer slot ``l`` of a tensor owns a contiguous run of pages, one per
  block; the tensors of different groups alias the same slots from byte 0.
  One region per slot, its block the page (``block_stride`` bytes).
* **block-outermost** (mixed page sizes, e.g. attention beside Mamba state):
  block ``b`` is one packed run of every layer's page. One region, the packed
  block (``block_stride`` bytes).

Either way block ``b`` of every region holds bytes that belong to block id
``b`` and to nothing else, whichever group owns that id: reading every region
at a request's block ids of all groups moves exactly its KV, one READ. A
region is never a layer's *view*: an SSM layer's state views, or attention
seen through a block-outermost buffer, are strided and not contiguous, but
their pages are.

Where the config has no strides (another vLLM), the per-layer tensors are
registered one region each (:func:`kvproto_transports.tensor_layout.layout_from_tensors`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvproto.tpmath import BlockLayout
from kvproto_transports.tensor_layout import layout_from_tensors, memory_kind_of

from .groups import UnsupportedShape, block_outermost

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class KvLayout:
    """What the worker registers, and how it was derived (for logs and the compat hash)."""

    layout: BlockLayout
    """Regions x blocks handed to the transport."""
    placement: str
    """``"layer-outermost"``, ``"block-outermost"``, or ``"per-layer tensors"``."""
    split_k_and_v: bool
    """Per-layer tensors only: K and V are separate regions (``[2, num_blocks, ...]``)."""
    region_names: list[str]
    """One layer name per region's first layer (stock interop names regions by layer)."""
    tensors: list[torch.Tensor]
    """What must outlive the registration (the transport keeps raw addresses)."""

    @property
    def slices_by_head(self) -> bool:
        """Whether a block is one layer's head-major page, so a TP slice of a block is a
        slice of its heads (heterogeneous TP); a packed block holds every layer's."""
        return self.placement != "block-outermost"


def kv_layout(
    kv_caches: Mapping[str, Any], kv_cache_config: Any | None, *, num_blocks: int
) -> KvLayout:
    """The layout of vLLM's ``register_kv_caches`` argument.

    Raises :class:`UnsupportedShape` when the placement cannot be read as regions of
    whole blocks (regions that overlap without coinciding)."""
    tensors_of = list(getattr(kv_cache_config, "kv_cache_tensors", None) or ())
    if tensors_of and all(hasattr(t, "block_stride") for t in tensors_of):
        backing = _backing(kv_caches)
        if backing is not None:
            return _from_placement(tensors_of, backing, kv_cache_config)
    names, tensors = unique_tensors(kv_caches)
    split = is_split_kv(tensors[0], num_blocks)
    layout = layout_from_tensors(tensors, split_k_and_v=split)
    return KvLayout(
        layout=layout,
        placement="per-layer tensors",
        split_k_and_v=split,
        region_names=names,
        tensors=tensors,
    )


def _backing(kv_caches: Mapping[str, Any]) -> torch.Tensor | None:
    """The one backing buffer every layer's view lives in, or None if there are several."""
    first: torch.Tensor | None = None
    ptrs = set()
    for value in kv_caches.values():
        for tensor in value if isinstance(value, list | tuple) else (value,):
            ptrs.add(int(tensor.untyped_storage().data_ptr()))
            if first is None:
                first = tensor
    return first if len(ptrs) == 1 else None


def _from_placement(tensors_of: Sequence[Any], backing: torch.Tensor, config: Any) -> KvLayout:
    import torch

    storage = backing.untyped_storage()
    base = int(storage.data_ptr())
    num_blocks = int(config.num_blocks)
    spans: dict[int, tuple[int, str]] = {}  # address -> (block bytes, first layer)
    packed = False
    for t in tensors_of:
        stride, step, offset = int(t.block_stride), int(t.layer_stride), int(t.offset)
        if block_outermost(t):
            # Block b is [b * stride, (b + 1) * stride) of every layer's page.
            packed = True
            if offset + len(t.layers) * step > stride:
                raise UnsupportedShape(f"layers of {t.layers[0]} overflow their packed block")
            spans.setdefault(base, (stride, t.layers[0]))
            continue
        for i, layer in enumerate(t.layers):
            spans.setdefault(base + offset + i * step, (stride, layer))
    if packed and len(spans) > 1:
        raise UnsupportedShape(
            "KV cache mixes block-outermost and layer-outermost placements; "
            "KvprotoConnector registers one of them"
        )
    addrs = sorted(spans)
    for a, b in itertools.pairwise(addrs):
        if a + spans[a][0] * num_blocks > b:
            raise UnsupportedShape(
                f"KV cache regions of {spans[a][1]} and {spans[b][1]} overlap without "
                "coinciding (groups whose pages differ in size)"
            )
    end = addrs[-1] + spans[addrs[-1]][0] * num_blocks
    if end > base + storage.nbytes():
        raise UnsupportedShape("KV cache placement runs past its backing buffer")
    kind, device_id = memory_kind_of(backing)
    layout = BlockLayout(
        region_addrs=tuple(addrs),
        block_lens=tuple(spans[a][0] for a in addrs),
        num_blocks=num_blocks,
        device_id=device_id,
        memory_kind=kind,
    )
    # The whole buffer stays referenced: every region lies inside it.
    whole = torch.empty(0, dtype=torch.int8, device=backing.device).set_(storage)
    return KvLayout(
        layout=layout,
        placement="block-outermost" if packed else "layer-outermost",
        split_k_and_v=False,
        region_names=[spans[a][1] for a in addrs],
        tensors=[whole],
    )


def unique_tensors(kv_caches: Mapping[str, Any]) -> tuple[list[str], list[torch.Tensor]]:
    """Per-layer names and tensors in layer order, each tensor once (layers may share)."""
    seen: set[int] = set()
    names, out = [], []
    for name, tensor in kv_caches.items():
        ptr = int(tensor.data_ptr())
        if ptr in seen:
            continue
        seen.add(ptr)
        names.append(name)
        out.append(tensor)
    if not out:
        raise ValueError("no KV cache tensors to register")
    return names, out


def is_split_kv(tensor: torch.Tensor, num_blocks: int) -> bool:
    """FlashAttention-style ``[2, num_blocks, ...]`` (K and V separate) or joined
    ``[num_blocks, ...]`` (the CPU backend packs K|V inside each block)."""
    shape = tuple(tensor.shape)
    return len(shape) >= 2 and shape[0] == 2 and shape[1] == num_blocks and num_blocks != 2
