"""Fixtures of the network-fault tests: a link between two namespaces, lease nodes on it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvproto_tools.netns import remove_stale, unavailable_reason

from .netns import Link

REASON = unavailable_reason()
REQUIRED = os.environ.get("KVPROTO_REQUIRE_NETNS") == "1"
"""Set by .ci/run where it installed the tools as root: then no namespace is a failure."""


def _skip_or_fail() -> None:
    if REASON is not None:
        if REQUIRED:
            pytest.fail(f"KVPROTO_REQUIRE_NETNS=1 but network namespaces: {REASON}")
        pytest.skip(f"network namespaces: {REASON}")


@pytest.fixture(scope="session", autouse=True)
def _no_stale_namespaces() -> None:
    """Delete namespaces a crashed earlier run left behind (they carry this module's prefix)."""
    if REASON is None:
        removed = remove_stale()
        if removed:
            print(f"\nremoved stale namespaces: {removed}")


@pytest.fixture
def netns_ok() -> None:
    """Skip (or, under KVPROTO_REQUIRE_NETNS=1, fail) where namespaces cannot be made."""
    _skip_or_fail()


def _made_link(*, delayer: bool = False) -> Iterator[Link]:
    _skip_or_fail()
    made = Link(delayer=delayer)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def link() -> Iterator[Link]:
    """A fresh two-host link, torn down after the test whatever happened."""
    yield from _made_link()


@pytest.fixture(scope="module")
def module_link() -> Iterator[Link]:
    """A two-host link shared by a module's tests (engines on it take most of their time)."""
    yield from _made_link()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama the engine tests here load (built once per module)."""
    pytest.importorskip("transformers", reason="transformers comes with vllm")
    from tests.vllm.tiny_model import build_tiny_llama

    model_dir: Path = build_tiny_llama(tmp_path_factory.mktemp("tinyllama"))
    return model_dir


@pytest.fixture
def delay_link() -> Iterator[Link]:
    """A two-host link through the delaying bridge."""
    yield from _made_link(delayer=True)
