"""Bindings: the small loops that run the sans-I/O cores against a clock and a transport.

- :mod:`kvproto_binding.endpoint`: :class:`Endpoint`, one engine rank's synchronous step
  (poll the transport, feed the cores, run their timers, carry out their outputs);
- :mod:`kvproto_binding.aio`: an asyncio driver around an endpoint;
- :mod:`kvproto_binding.sidechannel`: the ZMQ side channel that introduces engines and hands
  over transport metadata before the first frame.

The cores never import from here; transports (``kvproto_transports``) know nothing of it either.
"""

from __future__ import annotations

from .endpoint import Endpoint

__all__ = ["Endpoint"]
