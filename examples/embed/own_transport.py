"""The core on a transport of one's own: ``python -m examples.embed.own_transport``.

:class:`Mailboxes` implements :class:`kvproto.Transport` for endpoints in one
process: a notification is appended to the peer's inbox, a read copies the
peer's registered memory into one's own and then hands the peer its notify
(the order the protocol needs: the holder hears the done only once the data
left its memory). A real transport does the same over its wire: the binding
and the cores do not change.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from kvproto import (
    BlockLayout,
    BlockSlice,
    Capabilities,
    MemoryNotRegistered,
    PeerId,
    PeerLost,
    ReadCompleted,
    ReadId,
    Received,
    ThreadAffinity,
    TransportEvent,
    UnknownPeer,
)
from kvproto_transports import HostMemory

from .serve import one_request

BLOCK = 64


class Mailboxes:
    """One endpoint of an in-process transport; ``directory`` holds every endpoint."""

    name = "mailboxes"
    capabilities = Capabilities(
        max_notification_size=64 * 1024,
        ordered=True,
        may_duplicate=False,
        detects_peer_failure=False,
        failure_detection_bound_s=None,
        one_sided_reads=True,
        thread_affinity=ThreadAffinity.ANY,
    )

    def __init__(self, local_peer: PeerId, directory: dict[PeerId, Mailboxes]) -> None:
        self.local_peer = local_peer
        self.layout: BlockLayout | None = None
        self._directory, self._peers, self._next_read = directory, set[PeerId](), 1
        self._inbox: list[TransportEvent] = []
        directory[local_peer] = self

    def metadata(self) -> bytes:
        return self.local_peer.encode()

    def add_peer(self, metadata: bytes) -> PeerId:
        self._peers.add(metadata.decode())
        return metadata.decode()

    def remove_peer(self, peer: PeerId) -> None:
        self._peers.discard(peer)

    def send(self, peer: PeerId, payload: bytes) -> None:
        if peer not in self._peers:
            raise UnknownPeer(peer)
        self._directory[peer]._inbox.append(Received(peer=self.local_peer, payload=payload))

    def poll(self) -> Sequence[TransportEvent]:
        events, self._inbox = self._inbox, []
        return events

    def register_blocks(self, layout: BlockLayout) -> None:
        self.layout = layout

    def read_blocks(
        self,
        peer: PeerId,
        *,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        local_slice: BlockSlice = BlockSlice.FULL,
        remote_slice: BlockSlice = BlockSlice.FULL,
        notify: bytes | None = None,
    ) -> ReadId:
        # Whole blocks only (equal TP layouts); a TP-aware transport reads the slices.
        assert local_slice == remote_slice == BlockSlice.FULL
        if local_blocks:
            mine, theirs = self.layout, self._directory[peer].layout
            if mine is None or theirs is None:
                raise MemoryNotRegistered(f"{self.local_peer} or {peer} registered no memory")
            for region, size in enumerate(mine.block_lens):
                for local, remote in zip(local_blocks, remote_blocks, strict=True):
                    ctypes.memmove(
                        mine.region_addrs[region] + local * size,
                        theirs.region_addrs[region] + remote * size,
                        size,
                    )
        if notify is not None:  # after the data: the holder may free the blocks on it
            self.send(peer, notify)
        read_id, self._next_read = self._next_read, self._next_read + 1
        self._inbox.append(ReadCompleted(read_id=read_id))
        return read_id

    def close(self) -> None:
        del self._directory[self.local_peer]
        for peer in self._peers & set(self._directory):
            self._directory[peer]._inbox.append(PeerLost(peer=self.local_peer, reason="closed"))


def main() -> list[str]:
    """Serve one request over :class:`Mailboxes`; return what happened and what decode read."""
    directory: dict[PeerId, Mailboxes] = {}
    memory = HostMemory()  # zeroed ctypes buffers, kept alive as long as ``memory``
    prefill_wire, decode_wire = Mailboxes("prefill", directory), Mailboxes("decode", directory)
    prefill_layout = memory.allocate(num_regions=2, block_len=BLOCK, num_blocks=8)
    decode_layout = memory.allocate(num_regions=2, block_len=BLOCK, num_blocks=8)
    prefill_wire.register_blocks(prefill_layout)
    decode_wire.register_blocks(decode_layout)
    for block in (5, 6):
        memory.write_block(prefill_layout, 0, block, bytes([block]) * BLOCK)
    happened = one_request(prefill_wire, decode_wire)
    read = [memory.read_block(decode_layout, 0, block)[:1].hex() for block in (0, 1)]
    return [*happened, f"decode blocks 0, 1 hold prefill's 5, 6: {read == ['05', '06']}"]


if __name__ == "__main__":
    print("\n".join(main()))
