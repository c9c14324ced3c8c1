"""A reader configured for long leases still reads from a holder with short ones."""

from __future__ import annotations

from kvproto.config import LeaseConfig
from kvproto.events import ReadGo
from kvproto.holder import Holder
from tests.core.pair import Pair, counter_entropy


def test_read_margin_is_capped_by_the_holders_extension() -> None:
    pair = Pair(config=LeaseConfig())  # reader side: read_margin 5 s
    short = LeaseConfig(kv_lease_duration=6, read_margin=1.0)  # the holder advertises 6 s leases
    pair.holder = Holder(short, engine="P", incarnation=7, entropy=counter_entropy(1000))
    ticket = pair.grant_and_track(0.0)
    assert ticket.params.extension == 4
    pair.run_until(3.0, step=0.5)
    # Claim acknowledged at 0 with 6 s left: the bound is 6 s. A 5 s margin would decline at
    # 3.0 (3 + 5 >= 6); the margin capped at extension / 2 = 2 s lets the read go.
    assert isinstance(pair.reader.begin_read(3.0, "r1"), ReadGo)
