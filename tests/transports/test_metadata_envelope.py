"""The metadata blobs of the NIXL and UCX transports, pinned byte for byte.

Peers of different builds exchange these blobs, so their encoding is a wire
format: a refactoring of the code that writes them must not move a byte. Each
transport's example is encoded and compared with the bytes the transport
wrote when this test was added, decoded back, and the decoder's refusals
(kind, version, missing fields, bad layout) are pinned with their messages.
"""

from __future__ import annotations

import msgspec
import pytest

from kvproto.tpmath import BlockLayout
from kvproto.transport import BadMetadata
from kvproto_transports.nixl import wire as nixl_wire
from kvproto_transports.ucx import wire as ucx_wire

LAYOUT = BlockLayout(
    region_addrs=(0x90000, 0xA0000), block_lens=(256, 256), num_blocks=8, device_id=1
)

NIXL_WITH_LAYOUT = bytes.fromhex(
    "85a46b696e64ac6b7670726f746f2d6e69786ca776657273696f6e01aa6167656e745f6e616d65a7"
    "6570302d616263ae6167656e745f6d65746164617461c407006167656e74ffa66c61796f757485ac"
    "726567696f6e5f616464727392ce00090000ce000a0000aa626c6f636b5f6c656e7392cd0100cd01"
    "00aa6e756d5f626c6f636b7308a96465766963655f696401ab6d656d6f72795f6b696e64a44452414d"
)
NIXL_WITHOUT_LAYOUT = bytes.fromhex(
    "85a46b696e64ac6b7670726f746f2d6e69786ca776657273696f6e01aa6167656e745f6e616d65a7"
    "6570302d616263ae6167656e745f6d65746164617461c407006167656e74ffa66c61796f7574c0"
)
UCX_WITH_LAYOUT = bytes.fromhex(
    "87a46b696e64ab6b7670726f746f2d756378a776657273696f6e01a470656572b46570302d303030"
    "30303030303030303030306666ab696e6361726e6174696f6eccffae776f726b65725f6164647265"
    "7373c4050161646472a66c61796f757485ac726567696f6e5f616464727392ce00090000ce000a00"
    "00aa626c6f636b5f6c656e7392cd0100cd0100aa6e756d5f626c6f636b7308a96465766963655f69"
    "6401ab6d656d6f72795f6b696e64a44452414da5726b65797392c4026b30c4026b31"
)
UCX_WITHOUT_LAYOUT = bytes.fromhex(
    "87a46b696e64ab6b7670726f746f2d756378a776657273696f6e01a470656572b46570302d303030"
    "30303030303030303030306666ab696e6361726e6174696f6eccffae776f726b65725f6164647265"
    "7373c4050161646472a66c61796f7574c0a5726b65797390"
)


def _nixl(**over: object) -> nixl_wire.EndpointMetadata:
    fields: dict[str, object] = {
        "kind": nixl_wire.WIRE_KIND,
        "version": 1,
        "agent_name": "ep0-abc",
        "agent_metadata": b"\x00agent\xff",
        "layout": nixl_wire.layout_to_wire(LAYOUT),
    }
    fields.update(over)
    return nixl_wire.EndpointMetadata(**fields)  # type: ignore[arg-type]


def _ucx(**over: object) -> ucx_wire.UcxMetadata:
    fields: dict[str, object] = {
        "kind": ucx_wire.WIRE_KIND,
        "version": 1,
        "peer": "ep0-00000000000000ff",
        "incarnation": 255,
        "worker_address": b"\x01addr",
        "layout": ucx_wire.layout_to_wire(LAYOUT),
        "rkeys": (b"k0", b"k1"),
    }
    fields.update(over)
    return ucx_wire.UcxMetadata(**fields)  # type: ignore[arg-type]


def _bad_layout(**over: object) -> dict[str, object]:
    fields: dict[str, object] = {
        "region_addrs": [0x90000, 0xA0000],
        "block_lens": [256, 256],
        "num_blocks": 8,
        "device_id": 1,
        "memory_kind": "DRAM",
    }
    fields.update(over)
    return fields


def test_nixl_metadata_bytes_are_pinned() -> None:
    assert nixl_wire.encode_metadata(_nixl()) == NIXL_WITH_LAYOUT
    assert nixl_wire.encode_metadata(_nixl(layout=None)) == NIXL_WITHOUT_LAYOUT
    meta, layout = nixl_wire.decode_metadata(NIXL_WITH_LAYOUT)
    assert meta == _nixl()
    assert layout == LAYOUT
    assert nixl_wire.decode_metadata(NIXL_WITHOUT_LAYOUT) == (_nixl(layout=None), None)


def test_ucx_metadata_bytes_are_pinned() -> None:
    assert ucx_wire.encode_metadata(_ucx()) == UCX_WITH_LAYOUT
    assert ucx_wire.encode_metadata(_ucx(layout=None, rkeys=())) == UCX_WITHOUT_LAYOUT
    meta, layout = ucx_wire.decode_metadata(UCX_WITH_LAYOUT)
    assert meta == _ucx()
    assert layout == LAYOUT
    assert ucx_wire.decode_metadata(UCX_WITHOUT_LAYOUT) == (_ucx(layout=None, rkeys=()), None)


def _raw(meta: msgspec.Struct, **over: object) -> bytes:
    """``meta`` as a plain map with fields replaced, to forge what the Struct refuses."""
    fields = msgspec.to_builtins(meta, builtin_types=(bytes,))
    assert isinstance(fields, dict)
    fields.update(over)
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"\xc1", "not NIXL endpoint metadata: "),
        (msgspec.msgpack.encode({}), "not NIXL endpoint metadata: "),
        (UCX_WITH_LAYOUT, "not NIXL endpoint metadata: "),
        (
            _raw(_nixl(), kind="kvproto-ucx"),
            "metadata is for transport 'kvproto-ucx', not 'kvproto-nixl'",
        ),
        (_raw(_nixl(), version=2), "unsupported NIXL metadata version 2"),
        (_raw(_nixl(), agent_name=""), "metadata without an agent name or agent metadata"),
        (_raw(_nixl(), agent_metadata=b""), "metadata without an agent name or agent metadata"),
        (_raw(_nixl(), layout=_bad_layout(memory_kind="HBM")), "unknown memory kind 'HBM'"),
        (_raw(_nixl(), layout=_bad_layout(num_blocks=0)), "invalid layout in metadata: "),
        (_raw(_nixl(), layout=_bad_layout(extra=1)), "not NIXL endpoint metadata: "),
    ],
)
def test_nixl_refusals_are_pinned(blob: bytes, message: str) -> None:
    with pytest.raises(BadMetadata) as info:
        nixl_wire.decode_metadata(blob)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"\xc1", "not UCX endpoint metadata: "),
        (msgspec.msgpack.encode({}), "not UCX endpoint metadata: "),
        (NIXL_WITH_LAYOUT, "not UCX endpoint metadata: "),
        (
            _raw(_ucx(), kind="kvproto-nixl"),
            "metadata is for transport 'kvproto-nixl', not 'kvproto-ucx'",
        ),
        (_raw(_ucx(), version=2), "unsupported UCX metadata version 2"),
        (_raw(_ucx(), peer=""), "metadata without a peer id or worker address"),
        (_raw(_ucx(), worker_address=b""), "metadata without a peer id or worker address"),
        (_raw(_ucx(), layout=None), "remote keys without a layout"),
        (_raw(_ucx(), layout=_bad_layout(memory_kind="HBM")), "unknown memory kind 'HBM'"),
        (_raw(_ucx(), rkeys=[b"k0"]), "need one non-empty remote key per region"),
        (_raw(_ucx(), rkeys=[b"k0", b""]), "need one non-empty remote key per region"),
        (_raw(_ucx(), layout=_bad_layout(num_blocks=0)), "invalid layout in metadata: "),
        (_raw(_ucx(), layout=_bad_layout(extra=1)), "not UCX endpoint metadata: "),
    ],
)
def test_ucx_refusals_are_pinned(blob: bytes, message: str) -> None:
    with pytest.raises(BadMetadata) as info:
        ucx_wire.decode_metadata(blob)
    assert str(info.value).startswith(message)


def test_invalid_utf8_in_a_string_field_is_refused_not_raised() -> None:
    # msgspec raises UnicodeDecodeError (not DecodeError) for invalid UTF-8 in a str field.
    # Found by fuzz/fuzz_metadata.py: uncaught in decode_hello it ended the UCX engine
    # thread, so one bad HELLO from anyone reaching the listener lost every peer.
    bad_str = b"\xa1\xff"  # a 1-byte msgpack str holding 0xff
    assert ucx_wire.decode_hello(b"\x92" + bad_str + b"\xa1a") is None
    assert ucx_wire.decode_hello(b"\x9c" + b"\xab" * 24 + b"\n") is None  # the fuzzer's input
    for module in (nixl_wire, ucx_wire):
        with pytest.raises(BadMetadata, match=r"not .* endpoint metadata"):
            module.decode_metadata(b"\x81\xa4kind" + bad_str)  # {"kind": <0xff>}
