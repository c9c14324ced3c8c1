"""kvproto's benchmark suite: kvproto beside the vLLM lease v4 path and beside raw transports.

``kvproto bench`` delegates to :func:`main`; ``python -m kvproto_tools.bench``
does the same. Method and how to read the figures: ``spec/benchmarks.md``.
"""

from kvproto_tools.bench.cli import main

__all__ = ["main"]
