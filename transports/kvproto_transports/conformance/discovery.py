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

import re
from importlib.metadata import EntryPoint, PackageNotFoundError, entry_points, requires

from kvproto_transports.conformance.factory import TransportFactory

GROUP = "kvproto.transports"
"""The entry-point group transports register under."""


DISTRIBUTION = "kvproto"
"""The distribution whose extras install the built-in transports' libraries."""

EXTRAS_FALLBACK = {
    "nixl": ("nixl-cu12>=1.5", "numpy", "pyzmq>=25", "torch>=2.4"),
    "ucx": ("libucx-cu12==1.21.0", "numpy", "pyzmq>=25", "ucxx-cu12==0.52.0"),
}
"""Each transport extra's requirements, sorted, for a source tree run without installing it;
installed, the distribution's metadata says (tests hold this equal to pyproject.toml)."""

_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def extra_requirements(extra: str) -> tuple[str, ...]:
    """The requirements ``pip install 'kvproto[EXTRA]'`` adds, sorted, pins as declared.

    Read from the installed distribution's metadata, so the line a user is told
    to run always matches what pyproject.toml pins; :data:`EXTRAS_FALLBACK`
    where kvproto is not installed.
    """
    try:
        declared = requires(DISTRIBUTION)
    except PackageNotFoundError:
        return EXTRAS_FALLBACK.get(extra, ())
    found = []
    for line in declared or ():
        spec, _, marker = line.partition(";")
        m = _EXTRA_MARKER.search(marker)
        if m is not None and m.group(1) == extra:
            found.append(spec.strip())
    return tuple(sorted(found))


def install_hint(transport: str) -> str | None:
    """``pip install 'kvproto[NAME]' (installs A==1, B>=2)`` for a built-in transport, else None.

    A transport kvproto itself registers has an extra of its own name; a third
    party's does not, whatever its name.
    """
    ep = available().get(transport)
    dist = getattr(ep, "dist", None) if ep is not None else None
    if dist is not None and dist.name != DISTRIBUTION:
        return None
    reqs = extra_requirements(transport)
    if not reqs:
        return None
    return f"pip install '{DISTRIBUTION}[{transport}]' (installs {', '.join(reqs)})"


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
