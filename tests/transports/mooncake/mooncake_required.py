"""Skip a test that needs Mooncake's engine where ``mooncake.engine`` cannot be imported.

With ``KVPROTO_REQUIRE_MOONCAKE=1`` (CI sets it in its Mooncake step, once it has
installed the wheel and extracted the libraries its ``engine.so`` links) a missing
or broken engine is a failure, never a silent skip: the marked tests then run and
fail on :class:`~kvproto_transports.mooncake.MooncakeUnavailable`, which names the
cause, and :func:`require_mooncake` fails at once.
"""

from __future__ import annotations

import os

import pytest

from kvproto_transports.mooncake import mooncake_available, unavailable_reason

REQUIRE_ENV = "KVPROTO_REQUIRE_MOONCAKE"
REQUIRED = os.environ.get(REQUIRE_ENV) == "1"
"""Set by .ci/run where the engine was installed: then it must load."""

needs_mooncake = pytest.mark.skipif(
    not REQUIRED and not mooncake_available(), reason=f"Mooncake: {unavailable_reason()}"
)
"""Mark for a test or module that starts transfer engines."""


def require_mooncake() -> None:
    """Skip the calling test (fail it under ``KVPROTO_REQUIRE_MOONCAKE=1``) without the engine."""
    if mooncake_available():
        return
    if REQUIRED:
        pytest.fail(f"{REQUIRE_ENV}=1 but Mooncake: {unavailable_reason()}")
    pytest.skip(f"Mooncake: {unavailable_reason()}")
