"""Local blocks filled from several smaller holder blocks, put back in the local page order.

When the decoder's blocks hold ``ratio`` times the holder's tokens, holder block
``i`` of a request is read into part ``i % ratio`` of local block ``i // ratio``
(:func:`.groups.pair_blocks`): the bytes land as they lie in the holder's page.
In a token-major page (MLA's latent ``[N, C]``) that is already the local
order. In a head-major page each part holds every row ahead of the tokens for
``N / ratio`` tokens, so the parts are interleaved back,
``[ratio, R, N/ratio, C] -> [R, ratio, N/ratio, C]``. How many rows ``R`` a
page has ahead of its tokens is the attention backend's choice
(:data:`ROWS_PER_HEAD`): vLLM 0.32's CPU backend keeps, per KV head, the keys
of every token of the block and then their values (``[H, 2, N, D]``,
``cpu_attn.py`` views ``[H, N, 2D]`` as ``[H, 2N, D]``), so ``R = 2H``; a
``[H, N, 2D]`` reading of the same page (stock's
``kv_postprocess_blksize_on_receive``) mixes keys and values.

Parts no holder block filled -- past the request's last token, or before a
sliding window's reach -- are zeroed first: vLLM does not zero blocks of the
groups a connector loads (``skip_zeroing_group_ids``), and stale bytes in a
masked position still reach attention's sums (``0 * NaN``).

One :class:`PagedRegions` per worker, built at ``register_kv_caches`` from the
registered layout (the same regions the transport reads into); the regrouping
runs on the worker thread when the read is confirmed, before vLLM is told the
request finished receiving.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvproto.tpmath import BlockLayout

if TYPE_CHECKING:
    import torch

ROWS_PER_HEAD: dict[str, int] = {"CPU_ATTN": 2, "CPU_MLA": 0, "AMX_MLA": 0}
"""Per attention backend (``get_name()``), the rows of a page ahead of its tokens per KV head:
CPU_ATTN's ``[H, 2, N, D]`` has 2 (keys, then values); 0 = token-major (an MLA latent per
token). A backend not named here is not read in parts: its page order is not known."""


class CannotRegroup(ValueError):
    """The registered pages cannot be regrouped; the message names why (larger-block
    reads from this engine are then refused and recomputed)."""


@dataclass(frozen=True, slots=True)
class PagedRegions:
    """Every registered region as ``[num_blocks, page bytes]``, and its page's rows."""

    pages: tuple[torch.Tensor, ...]
    """Per region, a uint8 view of its pages (block ``b`` is row ``b``)."""
    rows: tuple[int, ...]
    """Per region, the rows of a page ahead of its tokens; 1 = token-major."""

    def regroup(
        self,
        ratio: int,
        local_blocks: Sequence[int],
        local_parts: Sequence[int],
        filled: Sequence[int],
    ) -> None:
        """Zero the parts of ``filled`` no pair wrote, then put their parts in page order.

        ``local_blocks[i]``/``local_parts[i]``: the part each holder block was read into."""
        import torch

        if not filled:
            return
        for page, rows in zip(self.pages, self.rows, strict=True):
            if page.shape[1] % (ratio * rows):
                raise CannotRegroup(
                    f"a page of {page.shape[1]} bytes does not split into {ratio} parts "
                    f"of {rows} rows"
                )
        row = {block: i for i, block in enumerate(filled)}
        written = torch.zeros(len(filled), ratio, dtype=torch.bool)
        for block, part in zip(local_blocks, local_parts, strict=True):
            written[row[block], part] = True
        index = torch.tensor(list(filled), dtype=torch.long)
        stale = ~written
        for page, rows in zip(self.pages, self.rows, strict=True):
            blocks = page.index_select(0, index).view(len(filled), ratio, -1)
            blocks[stale] = 0
            if rows > 1:
                per_row = blocks.view(len(filled), ratio, rows, -1).transpose(1, 2)
                blocks = per_row.reshape(len(filled), ratio, -1)
            page.index_copy_(0, index, blocks.reshape(len(filled), -1))


def paged_regions(
    layout: BlockLayout,
    tensors: Sequence[torch.Tensor],
    heads: Sequence[int],
    *,
    backend: str,
) -> PagedRegions:
    """The regions of ``layout`` (their memory inside ``tensors``) as page views.

    ``heads``: per region, the KV heads of its layers on this rank; ``backend``: the
    attention backend's name (:data:`ROWS_PER_HEAD`). Raises :class:`CannotRegroup`."""
    import torch

    rows_per_head = ROWS_PER_HEAD.get(backend)
    if rows_per_head is None:
        raise CannotRegroup(f"the page order of attention backend {backend} is not known")
    if len(heads) != layout.num_regions:
        raise CannotRegroup(f"{len(heads)} head counts for {layout.num_regions} regions")
    pages, rows = [], []
    for addr, block_len, n_heads in zip(layout.region_addrs, layout.block_lens, heads, strict=True):
        owner = next((t for t in tensors if _holds(t, addr, block_len * layout.num_blocks)), None)
        if owner is None:
            raise CannotRegroup(f"region at {addr:#x} lies in no registered tensor")
        storage = owner.untyped_storage()
        start = addr - int(storage.data_ptr())
        flat = torch.empty(0, dtype=torch.uint8, device=owner.device).set_(storage)
        span = flat[start : start + block_len * layout.num_blocks]
        pages.append(span.view(layout.num_blocks, -1))
        head_rows = n_heads * rows_per_head or 1
        if block_len % head_rows:
            raise CannotRegroup(f"a page of {block_len} bytes does not hold {head_rows} rows")
        rows.append(head_rows)
    return PagedRegions(pages=tuple(pages), rows=tuple(rows))


def region_heads(region_names: Sequence[str], kv_cache_config: Any) -> list[int]:
    """Per region (named by its first layer), the KV heads of its layers on this rank.

    Raises :class:`CannotRegroup` for a region whose layer no attention group names."""
    heads: dict[str, int] = {}
    for group in getattr(kv_cache_config, "kv_cache_groups", ()):
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)
        for layer in group.layer_names:
            layer_spec = per_layer[layer] if per_layer is not None else spec
            count = getattr(layer_spec, "num_kv_heads", None)
            if isinstance(count, int):
                heads[layer] = count
    missing = [name for name in region_names if name not in heads]
    if missing:
        raise CannotRegroup(f"no attention heads known for layer {missing[0]}")
    return [heads[name] for name in region_names]


def _holds(tensor: torch.Tensor, addr: int, nbytes: int) -> bool:
    storage = tensor.untyped_storage()
    base = int(storage.data_ptr())
    return base <= addr and addr + nbytes <= base + storage.nbytes()
