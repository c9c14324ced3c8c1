"""An eavesdropper replays D's frames from its own peer: nothing changes, D's read holds.

Without ``auth_secret``, an attacker who can read D's notifications replays D's Hello
from its own peer and sends a Done built from D's sniffed claim proof; were sessions not
keyed by the ticket, that would free the blocks early and fence D's read (LATE). The
Hello's anchor proof opens a session whose key the attacker cannot derive
(it needs the ticket's token, which never travels on the notification channel), so
the sniffed Done, unsigned or signed with any key it can guess, frees nothing.
"""

from __future__ import annotations

from kvproto import wire
from kvproto.events import FreeBlocks, ReadGo, SendFrame
from kvproto.ticket import claim_proof
from tests.core.pair import READER, Pair

ATTACKER = "X-agent"


def test_replayed_hello_and_sniffed_done_from_another_peer_free_nothing() -> None:
    pair = Pair()
    ticket = pair.holder.grant(0.0, request_id="p-r1")
    pair.reader.track(0.0, request_id="r1", ticket=ticket)
    pair.collect(0.0)
    sent = list(pair.to_holder)  # what an eavesdropper saw: D's Hello
    pair.deliver(0.0)
    pair.run_until(6.0, step=1.0)
    hello = next(p for p in sent if isinstance(wire.decode(p), wire.Hello))
    pair.holder.handle_frame(6.0, ATTACKER, hello)  # D's Hello, replayed from X's peer
    sniffed = claim_proof(ticket.token, "D", ticket.lease)
    done = wire.Done(claim=wire.Claim(lease=ticket.lease, proof=sniffed))
    for key in (None, bytes(16), sniffed):
        pair.holder.handle_frame(6.0, ATTACKER, wire.encode(done, key))
    out = pair.holder.drain()
    assert not [o for o in out if isinstance(o, FreeBlocks)]
    # The Welcome to X's peer is signed with a key X cannot compute; nothing else.
    answers = [wire.decode(o.payload) for o in out if isinstance(o, SendFrame)]
    assert [type(m) for m in answers] == [wire.Welcome]
    assert pair.holder.stats.bad_mac == 3

    go = pair.reader.begin_read(7.0, "r1")
    assert isinstance(go, ReadGo)
    pair.reader.read_completed(7.0, "r1", 0)
    pair.holder.handle_frame(7.0, READER, go.orders[0].notify)
    pair.deliver(7.0)
    assert pair.confirmed == ["r1"]
    assert pair.failed == []
