"""Checking output paths before the work runs.

A mistyped ``--json`` or ``--plot`` path must cost a one-line error at once,
not a traceback after a two-hour sweep. Every ``kvproto`` command that writes
a file checks it with :func:`check_output` before it starts.
"""

from __future__ import annotations

import os
from pathlib import Path

PLOT_SUFFIXES = (".png", ".svg", ".pdf")
"""Plot formats the commands write (chosen by the file's suffix)."""


class OutputPathError(ValueError):
    """An output path that cannot be written; the message is one line for the user."""


def check_output(path: str | os.PathLike[str], option: str, *, plot: bool = False) -> Path:
    """Return ``path`` as a Path if a file can be written there, else raise OutputPathError.

    The directory must exist and be writable, the path must not be a directory
    (or an existing read-only file), and a plot needs one of :data:`PLOT_SUFFIXES`.
    Nothing is created.
    """
    p = Path(path)
    if str(path) == "":
        raise OutputPathError(f"{option}: empty file name")
    if p.is_dir():
        raise OutputPathError(f"{option} {p}: is a directory, not a file")
    parent = p.parent
    if not parent.is_dir():
        raise OutputPathError(f"{option} {p}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"{option} {p}: directory {parent} is not writable")
    if p.exists() and not os.access(p, os.W_OK):
        raise OutputPathError(f"{option} {p}: file exists and is not writable")
    if plot and p.suffix.lower() not in PLOT_SUFFIXES:
        got = f"unsupported suffix '{p.suffix}'" if p.suffix else "no suffix"
        raise OutputPathError(
            f"{option} {p}: {got}; the suffix sets the format: "
            f"{', '.join(PLOT_SUFFIXES[:-1])} or {PLOT_SUFFIXES[-1]}"
        )
    return p
