"""The atheris targets in fuzz/ still run against today's cores, and their snapshot still sees.

CI has no atheris (it needs a clang toolchain to build), so nothing ran the targets
and their harness went stale twice when the cores' internals changed. Here each
target's own ``TestOneInput`` -- its contract assertions included -- runs over
its seeds and bit-flipped, truncated variants of them. atheris only instruments
imports and drives inputs; the stand-in below does neither and changes no
behaviour under test.
"""

from __future__ import annotations

import contextlib
import importlib
import random
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

FUZZ = Path(__file__).resolve().parents[2] / "fuzz"
TARGETS = ("fuzz_wire", "fuzz_legacy", "fuzz_ticket", "fuzz_handshake", "fuzz_metadata")


@pytest.fixture(scope="module")
def fuzz_dir() -> Iterator[None]:
    stand_in = types.ModuleType("atheris")
    stand_in.instrument_imports = lambda **_: contextlib.nullcontext()  # type: ignore[attr-defined]
    saved = sys.modules.get("atheris")
    sys.modules["atheris"] = stand_in
    sys.path.insert(0, str(FUZZ))
    try:
        yield
    finally:
        sys.path.remove(str(FUZZ))
        if saved is None:
            del sys.modules["atheris"]
        else:
            sys.modules["atheris"] = saved


def _variants(seeds: list[bytes], n: int, seed: int) -> Iterator[bytes]:
    rng = random.Random(seed)
    for _ in range(n):
        data = bytearray(rng.choice(seeds) or b"\x00")
        for _ in range(rng.randint(0, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.2:
            del data[rng.randrange(len(data)) :]
        yield bytes(data)


@pytest.mark.parametrize("name", TARGETS)
def test_each_target_holds_its_contract_on_mutated_seeds(fuzz_dir: None, name: str) -> None:
    target: Any = importlib.import_module(name)
    seeds = target.seeds()
    assert seeds, f"{name} has no seeds"
    for data in [*seeds, *_variants(seeds, 400, seed=len(name))]:
        target.TestOneInput(data)


def test_the_wire_harness_snapshot_sees_every_change_and_only_changes(fuzz_dir: None) -> None:
    harness: Any = importlib.import_module("_harness")
    pair = harness.Pair()
    assert pair.snapshot() == pair.copy().snapshot()
    before = pair.snapshot()
    pair.holder.handle_timer(1e6)  # every lease lapses: the holder's state moves
    assert pair.snapshot() != before
    after_holder = pair.snapshot()
    pair.reader.handle_timer(1e6)
    assert pair.snapshot() != after_holder
