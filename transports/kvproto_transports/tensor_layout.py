"""A :class:`~kvproto.tpmath.BlockLayout` from KV tensors, any transport (spec/vllm-api.md §9.1).

Two layouts exist in vLLM:

* **split K/V** (FlashAttention): each layer's tensor is ``[2, num_blocks, ...]``;
  ``t[0]`` (K) and ``t[1]`` (V) are separate regions, so regions = 2 x layers.
* **joined** (FlashInfer, MLA): each layer's tensor is ``[num_blocks, ...]`` with
  K and V (or the latent) inside one block; one region per layer.

A block's bytes are ``region_bytes // num_blocks``. For heterogeneous TP the
reader slices every block into equal parts, which is only a slice of the KV
heads when the block is head-major (vLLM's ``HND`` layout) and, for a joined
block, would cut across K and V: use split K/V (or TP ratio 1) with joined
layouts, as :class:`~kvproto.tpmath.BlockLayout` has no per-region stride.

The caller keeps the tensors alive for as long as the transport is registered:
the layout holds raw addresses only. torch is not imported here; any object
with torch's tensor API works.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvproto.errors import LocalProtocolError
from kvproto.tpmath import BlockLayout

if TYPE_CHECKING:
    import torch


def memory_kind_of(tensor: torch.Tensor) -> tuple[str, int]:
    """(NIXL memory kind, device id) of a tensor: ``DRAM`` on CPU, ``VRAM`` on a GPU."""
    device = tensor.device
    if device.type == "cpu":
        return "DRAM", 0
    return "VRAM", device.index if device.index is not None else 0


def layout_from_tensors(
    kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    *,
    split_k_and_v: bool,
) -> BlockLayout:
    """The layout of per-layer KV cache tensors, regions in layer (then K, V) order.

    ``kv_caches`` is a list of per-layer tensors or vLLM's ``{layer_name: tensor}``
    (insertion order is layer order). Every tensor must be contiguous, on one
    device, and hold the same number of blocks.
    """
    tensors = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    if not tensors:
        raise LocalProtocolError("no KV cache tensors")
    kinds = {memory_kind_of(t) for t in tensors}
    if len(kinds) != 1:
        raise LocalProtocolError(f"KV cache tensors live on several devices: {sorted(kinds)}")
    ((memory_kind, device_id),) = kinds
    addrs: list[int] = []
    lens: list[int] = []
    num_blocks: int | None = None
    for i, tensor in enumerate(tensors):
        if not tensor.is_contiguous():
            raise LocalProtocolError(f"KV cache tensor {i} is not contiguous")
        if split_k_and_v:
            if tensor.dim() < 2 or tensor.shape[0] != 2:
                raise LocalProtocolError(f"tensor {i}: split K/V needs shape [2, num_blocks, ...]")
            parts = [tensor[0], tensor[1]]
            blocks = int(tensor.shape[1])
        else:
            if tensor.dim() < 1:
                raise LocalProtocolError(f"tensor {i}: joined layout needs shape [num_blocks, ...]")
            parts = [tensor]
            blocks = int(tensor.shape[0])
        if num_blocks is None:
            num_blocks = blocks
        elif blocks != num_blocks:
            raise LocalProtocolError(f"tensor {i} has {blocks} blocks, layer 0 has {num_blocks}")
        for part in parts:
            nbytes = part.numel() * part.element_size()
            if blocks == 0 or nbytes % blocks:
                raise LocalProtocolError(
                    f"tensor {i}: {nbytes} bytes do not split into {blocks} blocks"
                )
            addrs.append(int(part.data_ptr()))
            lens.append(nbytes // blocks)
    assert num_blocks is not None
    return BlockLayout(
        region_addrs=tuple(addrs),
        block_lens=tuple(lens),
        num_blocks=num_blocks,
        device_id=device_id,
        memory_kind=memory_kind,
    )
