"""Pure parts of the UCX transport: read planning and metadata decoding (no UCX needed)."""

from __future__ import annotations

import msgspec
import pytest

from kvproto.tpmath import BlockLayout, BlockSlice
from kvproto.transport import BadMetadata, MemoryNotRegistered
from kvproto_transports.ucx.errors import LayoutMismatch
from kvproto_transports.ucx.plan import Segment, plan_read
from kvproto_transports.ucx.wire import (
    WIRE_KIND,
    FrameKind,
    UcxMetadata,
    decode_hello,
    decode_metadata,
    encode_metadata,
    hello_body,
    layout_to_wire,
    make_tag,
    split_tag,
)

LOCAL = BlockLayout(region_addrs=(0x10000, 0x20000), block_lens=(256, 256), num_blocks=8)
REMOTE = BlockLayout(region_addrs=(0x90000, 0xA0000), block_lens=(256, 256), num_blocks=8)


def test_consecutive_blocks_merge_into_one_segment_per_region() -> None:
    segs = plan_read(LOCAL, REMOTE, local_blocks=[0, 1, 2], remote_blocks=[5, 6, 7])
    assert segs == [
        Segment(region=0, local_addr=0x10000, remote_addr=0x90000 + 5 * 256, length=768),
        Segment(region=1, local_addr=0x20000, remote_addr=0xA0000 + 5 * 256, length=768),
    ]


def test_scattered_blocks_stay_separate() -> None:
    segs = plan_read(LOCAL, REMOTE, local_blocks=[0, 1], remote_blocks=[3, 1])
    assert [
        (
            s.region,
            s.local_addr - LOCAL.region_addrs[s.region],
            s.remote_addr - REMOTE.region_addrs[s.region],
            s.length,
        )
        for s in segs
    ] == [
        (0, 0, 3 * 256, 256),
        (0, 256, 1 * 256, 256),
        (1, 0, 3 * 256, 256),
        (1, 256, 1 * 256, 256),
    ]


def test_slices_cut_every_block_and_never_merge_across_the_gap() -> None:
    local = BlockLayout(region_addrs=(0x10000,), block_lens=(128,), num_blocks=4)
    remote = BlockLayout(region_addrs=(0x90000,), block_lens=(256,), num_blocks=4)
    segs = plan_read(
        local,
        remote,
        local_blocks=[0, 1],
        remote_blocks=[2, 3],
        remote_slice=BlockSlice(index=1, parts=2),
    )
    assert segs == [
        Segment(region=0, local_addr=0x10000, remote_addr=0x90000 + 2 * 256 + 128, length=128),
        Segment(region=0, local_addr=0x10080, remote_addr=0x90000 + 3 * 256 + 128, length=128),
    ]


@pytest.mark.parametrize(
    ("local_blocks", "remote_blocks"),
    [([0], [8]), ([8], [0]), ([0], [10**6]), ([-1], [0])],
)
def test_blocks_outside_either_layout_are_refused(
    local_blocks: list[int], remote_blocks: list[int]
) -> None:
    with pytest.raises(MemoryNotRegistered):
        plan_read(LOCAL, REMOTE, local_blocks=local_blocks, remote_blocks=remote_blocks)


def test_mismatched_layouts_are_refused() -> None:
    one_region = BlockLayout(region_addrs=(0x1,), block_lens=(256,), num_blocks=8)
    with pytest.raises(LayoutMismatch):
        plan_read(LOCAL, one_region, local_blocks=[0], remote_blocks=[0])
    with pytest.raises(LayoutMismatch):
        plan_read(LOCAL, REMOTE, local_blocks=[0, 1], remote_blocks=[0])
    with pytest.raises(LayoutMismatch):  # 256-byte halves into 256-byte blocks
        plan_read(
            LOCAL,
            REMOTE,
            local_blocks=[0],
            remote_blocks=[0],
            remote_slice=BlockSlice(index=0, parts=2),
        )


def _meta(**over: object) -> UcxMetadata:
    fields: dict[str, object] = {
        "kind": WIRE_KIND,
        "version": 1,
        "peer": "p-1",
        "incarnation": 7,
        "worker_address": b"\x01addr",
        "layout": layout_to_wire(REMOTE),
        "rkeys": (b"k0", b"k1"),
    }
    fields.update(over)
    return UcxMetadata(**fields)  # type: ignore[arg-type]


def test_metadata_round_trip() -> None:
    meta, layout = decode_metadata(encode_metadata(_meta()))
    assert meta.peer == "p-1"
    assert layout == REMOTE


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"\xff\x00garbage",
        msgspec.msgpack.encode({}),
        encode_metadata(_meta(kind="kvproto-nixl")),
        encode_metadata(_meta(version=99)),
        encode_metadata(_meta(worker_address=b"")),
        encode_metadata(_meta(rkeys=(b"k0",))),  # one key for two regions
        encode_metadata(_meta(layout=None)),  # keys without a layout
    ],
)
def test_unusable_metadata_is_bad_metadata(blob: bytes) -> None:
    with pytest.raises(BadMetadata):
        decode_metadata(blob)


def test_tags_carry_kind_and_sender() -> None:
    key = (1 << 56) - 3
    assert split_tag(make_tag(FrameKind.NOTIFY, key)) == (FrameKind.NOTIFY, key)
    hello = decode_hello(hello_body("a", "b"))
    assert hello is not None and (hello.sender, hello.target) == ("a", "b")
    assert decode_hello(b"\xc1") is None
