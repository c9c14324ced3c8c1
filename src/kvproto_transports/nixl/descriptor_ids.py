"""A READ's NIXL descriptor indices, built with one vectorised step per request.

A prepared descriptor list holds ``num_regions x num_blocks`` entries
(``desc_id = region * num_blocks + block``, :func:`kvproto.tpmath.descriptor_ids`);
``make_prepped_xfer`` wants the indices of one READ as an ``int32`` array. The
pure-Python list that ``descriptor_ids`` builds cost ~40 µs per side of a
64-block, 8-region READ (most of NixlTransport's per-request cost over raw
NIXL); here the region offsets are computed once per layout and a request
costs one conversion of its block ids and one broadcast add.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvproto.tpmath import BlockLayout, descriptor_ids


class DescriptorIds:
    """Block ids -> descriptor indices of every region, for one layout."""

    __slots__ = ("_num_blocks", "_num_regions", "_offsets")

    def __init__(self, layout: BlockLayout) -> None:
        self._num_regions = layout.num_regions
        self._num_blocks = layout.num_blocks
        self._offsets = (np.arange(layout.num_regions, dtype=np.int32) * layout.num_blocks)[:, None]

    def of(self, blocks: Sequence[int]) -> np.ndarray:
        """``descriptor_ids(blocks, ...)`` as a flat ``int32`` array (region-major).

        Raises :class:`~kvproto.errors.LocalProtocolError` naming the first block
        outside the layout, exactly as ``descriptor_ids`` does.
        """
        if len(blocks) and (min(blocks) < 0 or max(blocks) >= self._num_blocks):
            descriptor_ids(blocks, self._num_regions, self._num_blocks)  # raises, naming the block
        ids = np.add(self._offsets, np.asarray(blocks, dtype=np.int32))
        ids.shape = (-1,)
        return ids
