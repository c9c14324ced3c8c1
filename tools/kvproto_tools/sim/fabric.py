"""The network as the simulator sees it: loopback links, live endpoints, reads in flight."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvproto.transport import PeerId, ReadId
    from kvproto_tools.sim.model import EngineState, ReadRec
    from kvproto_tools.sim.transport import SimTransport
    from kvproto_transports.loopback import LinkFaults, LoopbackNetwork


class Fabric:
    """The loopback network, which endpoint is which engine rank, and the reads in flight."""

    __slots__ = ("live", "net", "owner", "reads")

    def __init__(self, net: LoopbackNetwork) -> None:
        self.net = net
        """The seeded loopback network (links, partitions, crashes)."""
        self.live: list[SimTransport] = []
        """Endpoints of live engine incarnations, drained after every event."""
        self.owner: dict[PeerId, tuple[EngineState, int]] = {}
        """Endpoint -> (engine, rank)."""
        self.reads: dict[tuple[PeerId, ReadId], ReadRec] = {}
        """Reads issued and not yet copied or failed, by (reader endpoint, read handle)."""

    def cut(self, a: EngineState, b: EngineState, *, heal: bool) -> None:
        """Partition (or heal) every link between two engines' ranks."""
        for ra in range(a.tp):
            for rb in range(b.tp):
                if heal:
                    self.net.heal(f"{a.name}r{ra}", f"{b.name}r{rb}")
                else:
                    self.net.partition(f"{a.name}r{ra}", f"{b.name}r{rb}")

    def set_links(self, a: EngineState, b: EngineState, faults: LinkFaults) -> None:
        """Set the faults of every link between two engines' ranks, both ways."""
        for ra in range(a.tp):
            for rb in range(b.tp):
                self.net.set_link(f"{a.name}r{ra}", f"{b.name}r{rb}", faults)
                self.net.set_link(f"{b.name}r{rb}", f"{a.name}r{ra}", faults)

    def crash(self, eng: EngineState) -> None:
        """``kill -9``: the engine's endpoints vanish from the network."""
        for tr in eng.transports:
            self.net.crash(tr.real.base_name)
        gone = eng.transports
        self.live = [tr for tr in self.live if all(tr is not g for g in gone)]
