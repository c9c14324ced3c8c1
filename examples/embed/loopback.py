"""The core on the in-process loopback transport: ``python -m examples.embed.loopback``.

The loopback network is a deterministic wire whose time moves only when told
(``net.advance(now)``), with real memory behind every endpoint: decode's read
copies prefill's bytes.
"""

from __future__ import annotations

from kvproto_transports import LinkFaults, LoopbackNetwork

from .serve import one_request

BLOCK = 64
"""Bytes a block (per region)."""


def main() -> list[str]:
    """Serve one request over loopback; return what happened and what decode read."""
    net = LoopbackNetwork(seed=1)
    prefill_wire, decode_wire = net.endpoint("prefill"), net.endpoint("decode")
    for a, b in (("prefill", "decode"), ("decode", "prefill")):
        net.set_link(a, b, LinkFaults(delay=0.001))  # 1 ms each way
    # KV memory: 2 regions (say, K and V) of 8 blocks on each side.
    prefill_wire.register_blocks(prefill_wire.allocate_layout(2, BLOCK, 8))
    decode_wire.register_blocks(decode_wire.allocate_layout(2, BLOCK, 8))
    for block in (5, 6):
        prefill_wire.write_block(0, block, bytes([block]) * BLOCK)
    happened = one_request(prefill_wire, decode_wire, clock_moved=net.advance)
    read = [decode_wire.read_block(0, block)[:1].hex() for block in (0, 1)]
    return [*happened, f"decode blocks 0, 1 hold prefill's 5, 6: {read == ['05', '06']}"]


if __name__ == "__main__":
    print("\n".join(main()))
