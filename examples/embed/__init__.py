"""Embedding the core: a holder and a reader, a transport, a clock and a step loop.

``python -m examples.embed.loopback``: over the in-process loopback transport.
``python -m examples.embed.own_transport``: over a transport of one's own, written
in a few dozen lines against :class:`kvproto.Transport`.
Both serve one request through :func:`examples.embed.serve.one_request`.
"""
