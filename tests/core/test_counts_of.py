"""counts_of: what dataclasses.asdict gives for flat counter classes, cheaply."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import pytest

from kvproto.stats import HolderStats, ReaderStats, counts_of
from kvproto_binding.sidechannel.server import ServerStats
from kvproto_binding.step import BindingStats


@dataclass(slots=True)
class _One:
    only: int = 7


@pytest.mark.parametrize("cls", [HolderStats, ReaderStats, BindingStats, ServerStats, _One])
def test_counts_of_equals_asdict_with_distinct_values(cls: type) -> None:
    counters = cls(**{f.name: i + 1 for i, f in enumerate(fields(cls))})
    assert counts_of(counters) == asdict(counters)
    assert list(counts_of(counters)) == [f.name for f in fields(cls)]  # declaration order


def test_prefix_applies_to_every_key_and_is_cached_per_prefix() -> None:
    stats = ReaderStats(tracked=3, acks=2)
    assert counts_of(stats, "reader_") == {f"reader_{k}": v for k, v in asdict(stats).items()}
    assert counts_of(stats) == asdict(stats)  # another prefix, another cache entry
    stats.tracked += 1
    assert counts_of(stats, "reader_")["reader_tracked"] == 4  # values read afresh


def test_one_field_class() -> None:
    assert counts_of(_One(), "p_") == {"p_only": 7}
