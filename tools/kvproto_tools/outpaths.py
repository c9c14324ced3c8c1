"""Checking output paths before the work runs.

A mistyped ``--json`` or ``--plot`` path must cost a one-line error at once,
not a traceback after a two-hour sweep. Every ``kvproto`` command that writes
a file checks it with :func:`check_output` before it starts, and writes it
inside :func:`writing`, which turns a failure the check could not foresee
(the disk filling up meanwhile) into the same kind of one-line error.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

PLOT_SUFFIXES = (".png", ".svg", ".pdf")
"""Plot formats the commands write (chosen by the file's suffix)."""


class OutputPathError(ValueError):
    """An output path that cannot be written; the message is one line for the user."""


def check_output(path: str | os.PathLike[str], option: str, *, plot: bool = False) -> Path:
    """Return ``path`` as a Path if a file can be written there, else raise OutputPathError.

    The checks read the file system as the write will: the path must not be a
    directory, its parent must be a writable directory (a file in the way is
    named as such), a plot needs one of :data:`PLOT_SUFFIXES`, and the path is
    really opened for writing. An existing file is opened without truncating it
    and a missing one is created and removed again, because only the kernel
    knows every reason a write fails (a name too long, a read-only or virtual
    file system such as /sys or /proc, a device such as /dev/full).
    """
    if str(path) == "":
        raise OutputPathError(f"{option}: empty file name")
    p = Path(path)
    if plot and p.suffix.lower() not in PLOT_SUFFIXES:
        got = f"unsupported suffix '{p.suffix}'" if p.suffix else "no suffix"
        raise OutputPathError(
            f"{option} {p}: {got}; the suffix sets the format: "
            f"{', '.join(PLOT_SUFFIXES[:-1])} or {PLOT_SUFFIXES[-1]}"
        )
    mode = _mode(p)
    if mode is not None and stat.S_ISDIR(mode):
        raise OutputPathError(f"{option} {p}: is a directory, not a file")
    _check_parent(p, option)
    if mode is not None and not os.access(p, os.W_OK):
        raise OutputPathError(f"{option} {p}: file exists and is not writable")
    try:
        _probe(p, mode)
    except OSError as exc:
        raise OutputPathError(f"{option} {p}: cannot write there: {_reason(exc)}") from None
    return p


@contextlib.contextmanager
def writing(path: str | os.PathLike[str], option: str) -> Iterator[None]:
    """Turn an OSError of the write inside the block into :class:`OutputPathError`."""
    try:
        yield
    except OSError as exc:
        raise OutputPathError(f"{option} {path}: writing failed: {_reason(exc)}") from None


def _mode(p: Path) -> int | None:
    """``st_mode`` of what ``p`` names, or None when nothing is there (or it cannot be asked)."""
    try:
        return os.stat(p).st_mode
    except OSError:
        return None


def _check_parent(p: Path, option: str) -> None:
    """The parent directory exists and is writable; else say which part of the path is wrong."""
    parent = p.parent
    for above in (parent, *parent.parents):
        mode = _mode(above)
        if mode is None:
            continue
        if not stat.S_ISDIR(mode):
            raise OutputPathError(f"{option} {p}: {above} is a file, not a directory")
        if above != parent:
            raise OutputPathError(f"{option} {p}: directory {parent} does not exist")
        break
    else:
        raise OutputPathError(f"{option} {p}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"{option} {p}: directory {parent} is not writable")


def _probe(p: Path, mode: int | None) -> None:
    """Open ``p`` for writing as the command will, changing nothing that is there.

    A FIFO is left alone: opening it would wait for a reader. Elsewhere a
    zero-byte write is harmless (no data, no truncation) but reaches the
    driver, so a device that refuses every write (/dev/full) refuses it.
    """
    if mode is not None and stat.S_ISFIFO(mode):
        return
    if mode is not None:
        fd = os.open(p, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"")
        finally:
            os.close(fd)
        return
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return  # a dangling symlink or a file made meanwhile: the write will tell
    os.close(fd)
    os.unlink(p)


def _reason(exc: OSError) -> str:
    """The error in words, without Python's ``[Errno N]`` and the repeated file name."""
    return exc.strerror.lower() if exc.strerror else str(exc)
