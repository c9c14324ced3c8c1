"""Without auth_secret an eavesdropper can impersonate a reader; the data is still never trusted.

Threat model: an attacker who can read D's notifications replays D's Hello from
its own peer and sends a Done built from D's sniffed claim proof. That frees the
blocks early (a denial of service, out of scope without ``auth_secret``), but
D's own done then arrives at an ended lease from another session and is
answered LATE, so D fences its read and recomputes instead of using freed blocks.
"""

from __future__ import annotations

from kvproto import wire
from kvproto.events import FailReason, FreeBlocks, ReadGo, ReleaseReason
from kvproto.ticket import claim_proof
from tests.core.pair import READER, Pair

ATTACKER = "X-agent"


def test_impersonated_done_frees_early_but_the_real_read_is_fenced() -> None:
    pair = Pair()
    ticket = pair.grant_and_track(0.0)
    pair.run_until(6.0, step=1.0)
    # The attacker's copy of D's identity and of D's proof for this lease.
    hello = wire.Hello(engine="D", rank=0, tp_size=1, incarnation=9, nonce=bytes(16))
    pair.holder.handle_frame(6.0, ATTACKER, wire.encode(hello))
    sniffed = claim_proof(ticket.token, "D", ticket.lease)
    pair.holder.handle_frame(
        6.0, ATTACKER, wire.encode(wire.Done(claim=wire.Claim(lease=ticket.lease, proof=sniffed)))
    )
    # The holder's answers go to the attacker's peer, not to D.
    freed = [o for o in pair.holder.drain() if isinstance(o, FreeBlocks)]
    assert [f.reason for f in freed] == [ReleaseReason.DONE]

    go = pair.reader.begin_read(7.0, "r1")
    assert isinstance(go, ReadGo)
    pair.reader.read_completed(7.0, "r1", 0)
    pair.holder.handle_frame(7.0, READER, go.orders[0].notify)
    pair.deliver(7.0)
    assert pair.confirmed == []
    assert [f.reason for f in pair.failed] == [FailReason.FENCED_LATE]
