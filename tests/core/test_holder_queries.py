"""Holder queries a binding asks instead of catching LocalProtocolError."""

from __future__ import annotations

import msgspec
import pytest

from kvproto.config import LeaseConfig
from kvproto.errors import LocalProtocolError
from kvproto.holder import Holder


def _holder() -> Holder:
    return Holder(LeaseConfig(), engine="P", incarnation=1)


def test_live_deadline_is_the_deadline_while_live_and_none_after() -> None:
    holder = _holder()
    ticket = holder.grant(0.0, request_id="r")
    assert holder.is_live(ticket.lease)
    assert holder.live_deadline(ticket.lease) == holder.deadline(ticket.lease)
    holder.revoke(1.0, ticket.lease)
    assert not holder.is_live(ticket.lease)
    assert holder.live_deadline(ticket.lease) is None
    with pytest.raises(LocalProtocolError):
        holder.deadline(ticket.lease)
    assert holder.live_deadline(12345) is None
    assert not holder.is_live(12345)


def test_adoption_problem_names_what_adopt_refuses() -> None:
    minter = _holder()
    holder = _holder()
    ticket = minter.grant(0.0, request_id="r")
    assert holder.adoption_problem(ticket) is None
    holder.adopt(0.0, ticket)
    assert holder.adoption_problem(ticket) == f"lease {ticket.lease} already held"
    other = Holder(LeaseConfig(), engine="P", incarnation=2)
    assert other.adoption_problem(ticket) is not None
    twin = msgspec.structs.replace(minter.grant(0.0, request_id="r2"), request_id="r")
    problem = holder.adoption_problem(twin)
    assert problem == "request 'r' already has a lease"
    with pytest.raises(LocalProtocolError, match="already has a lease"):
        holder.adopt(0.0, twin)
    bad = msgspec.structs.replace(minter.grant(0.0, request_id="r3"), token=b"short")
    assert (holder.adoption_problem(bad) or "").startswith("bad ticket:")
