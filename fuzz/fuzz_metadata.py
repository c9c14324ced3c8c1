"""atheris target: transport endpoint metadata and UCX HELLO bodies, as peers send them.

``add_peer(metadata)`` takes bytes a remote process produced (through the side channel's
introductions), so the NIXL and UCX metadata decoders parse peer input, and a UCX listener
decodes every HELLO body it is sent. Contract: ``decode_metadata`` returns
``(metadata, layout)`` or raises :class:`~kvproto.transport.BadMetadata`; accepted metadata
re-encodes and decodes to itself; ``decode_hello`` returns a Hello or None, never raises.
"""

from __future__ import annotations

import sys

import atheris
import msgspec  # noqa: F401  (imported first: only kvproto_transports is instrumented)

with atheris.instrument_imports(include=["kvproto_transports"]):
    from _harness import write_seeds

    from kvproto.tpmath import BlockLayout
    from kvproto.transport import BadMetadata
    from kvproto_transports.metadata_envelope import layout_to_wire
    from kvproto_transports.nixl import wire as nixl_wire
    from kvproto_transports.ucx import wire as ucx_wire


def TestOneInput(data: bytes) -> None:
    for module in (nixl_wire, ucx_wire):
        try:
            meta, _layout = module.decode_metadata(data)
        except BadMetadata:
            continue
        again, _ = module.decode_metadata(module.encode_metadata(meta))  # type: ignore[arg-type]
        assert again == meta
    hello = ucx_wire.decode_hello(data)
    if hello is not None:
        assert ucx_wire.decode_hello(ucx_wire.hello_body(hello.sender, hello.target)) == hello


def seeds() -> list[bytes]:
    layout = layout_to_wire(
        BlockLayout(region_addrs=(4096, 8192), block_lens=(64, 64), num_blocks=4)
    )
    nixl = nixl_wire.EndpointMetadata(
        kind=nixl_wire.WIRE_KIND,
        version=nixl_wire.WIRE_VERSION,
        agent_name="P-1",
        agent_metadata=b"agent",
        layout=layout,
    )
    ucx = ucx_wire.UcxMetadata(
        kind=ucx_wire.WIRE_KIND,
        version=ucx_wire.WIRE_VERSION,
        peer="D-1",
        incarnation=3,
        worker_address=b"addr",
        rkeys=(b"k0", b"k1"),
        layout=layout,
    )
    return [
        nixl_wire.encode_metadata(nixl),
        ucx_wire.encode_metadata(ucx),
        ucx_wire.hello_body("D-1", "P-1"),
    ]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write-seeds"]:
        write_seeds(sys.argv[2], seeds())
    else:
        atheris.Setup(sys.argv, TestOneInput)
        atheris.Fuzz()
