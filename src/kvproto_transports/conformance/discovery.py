"""Find transports through the ``kvproto.transports`` entry-point group.

A third-party package makes its transport testable exactly like the built-in
ones by declaring, in its own pyproject.toml::

    [project.entry-points."kvproto.transports"]
    mooncake = "my_package.kvproto_factory:conformance_factory"

The target is a :class:`TransportFactory` or a zero-argument callable that
returns one (called only when that transport is selected, so listing
transports never imports heavy libraries).
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

from kvproto_transports.conformance.factory import TransportFactory

GROUP = "kvproto.transports"
"""The entry-point group transports register under."""


class UnknownTransport(LookupError):
    """No entry point of that name in ``kvproto.transports``."""


def available() -> dict[str, EntryPoint]:
    """Name -> entry point of every installed transport."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def load_factory(name: str) -> TransportFactory:
    """Load and, if needed, call the entry point ``name``."""
    eps = available()
    if name not in eps:
        known = ", ".join(sorted(eps)) or "none installed"
        raise UnknownTransport(f"no transport {name!r} in entry points {GROUP!r} ({known})")
    return as_factory(eps[name].load())


def as_factory(obj: object) -> TransportFactory:
    """Accept a TransportFactory or a zero-argument callable returning one."""
    if isinstance(obj, TransportFactory):
        return obj
    if callable(obj):
        made = obj()
        if isinstance(made, TransportFactory):
            return made
        raise TypeError(f"{obj!r}() returned {type(made).__name__}, not TransportFactory")
    raise TypeError(f"{obj!r} is neither a TransportFactory nor a callable returning one")
