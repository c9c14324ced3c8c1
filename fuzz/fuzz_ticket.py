"""atheris target: lease tickets from kv_transfer_params (LeaseTicket.from_params).

The input is read as JSON, as the routing proxy forwards it. Contract: from_params
returns a ticket or raises RemoteProtocolError (also for non-mappings); a returned
ticket round-trips through to_params, and a reader tracking it never raises, now or
when it heartbeats (a lease id beyond uint64 used to raise there).
"""

from __future__ import annotations

import sys

import atheris
import msgspec  # noqa: F401  (imported first: only kvproto is instrumented)

# Only kvproto is instrumented (the harness and msgspec are not: less noise, faster).
with atheris.instrument_imports(include=["kvproto"]):
    from _harness import CONFIG, Pair, ticket_from_json, ticket_seeds, write_seeds

    from kvproto.errors import RemoteProtocolError
    from kvproto.reader import Reader
    from kvproto.ticket import LeaseTicket

TEMPLATE = Pair()


def TestOneInput(data: bytes) -> None:
    value = ticket_from_json(data)
    try:
        ticket = LeaseTicket.from_params(value)
    except RemoteProtocolError:
        return
    assert LeaseTicket.from_params(ticket.to_params()) == ticket
    reader = Reader(CONFIG, engine="D", incarnation=1)
    reader.track(0.0, request_id="x", ticket=ticket)
    for out in reader.drain():
        if hasattr(out, "engine"):  # Connect: pretend the holder is reachable
            reader.connected(0.0, engine=out.engine, rank=out.rank, peer="P")
    reader.handle_timer(100.0)
    reader.drain()


def seeds() -> list[bytes]:
    return ticket_seeds(TEMPLATE)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write-seeds"]:
        write_seeds(sys.argv[2], seeds())
    else:
        atheris.Setup(sys.argv, TestOneInput)
        atheris.Fuzz()
