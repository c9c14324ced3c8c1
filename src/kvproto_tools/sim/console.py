"""Terminal output with rich when it is installed, plain text when it is not.

rich (and matplotlib, for ``--plot``) come with the ``tools`` extra. The
simulator's table, legend and conclusions need neither: without rich they are
printed as aligned plain text, so ``pip install kvproto`` alone gives a
working ``kvproto simulate``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, TextIO, cast

_MARKUP = re.compile(r"\[/?(?:bold|dim|red|green|cyan|yellow)?\]")
"""The rich markup tags this package writes (nothing else in a line is touched)."""


def strip_markup(text: str) -> str:
    """``text`` without the style tags (``[red]``, ``[/red]``, ``[/]``, ...)."""
    return _MARKUP.sub("", text)


class Out(Protocol):
    """What the commands print through (a rich Console or :class:`PlainConsole`)."""

    def print(self, *objects: Any, markup: bool | None = ..., highlight: bool | None = ...) -> None:
        """Print one line (or a table)."""


class PlainConsole:
    """A stand-in for rich's Console: the same ``print`` calls, styles dropped."""

    def __init__(self, file: TextIO | None = None) -> None:
        self.file = file

    def print(
        self, *objects: Any, markup: bool | None = None, highlight: bool | None = None
    ) -> None:
        """Print ``objects`` separated by spaces; style tags are dropped unless ``markup=False``."""
        text = " ".join(str(o) for o in objects)
        print(text if markup is False else strip_markup(text), file=self.file or sys.stdout)


def make_console(width: int | None = None) -> Out:
    """A rich Console (``width`` columns when not a terminal) or a plain one without rich.

    Everything else in this module tells the two apart by type: anything that is
    not a :class:`PlainConsole` is rich's.
    """
    try:
        from rich.console import Console
    except ImportError:
        return PlainConsole()
    return Console() if sys.stdout.isatty() else Console(width=width)


def progress(out: Out, total: int) -> AbstractContextManager[Callable[[], None]]:
    """A progress bar over ``total`` steps (rich only; nothing without it)."""
    if isinstance(out, PlainConsole):
        return nullcontext(lambda: None)
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=cast(Console, out),
        transient=True,
    )
    return _RichProgress(bar, total)


class _RichProgress(AbstractContextManager[Callable[[], None]]):
    def __init__(self, bar: Any, total: int) -> None:
        self.bar = bar
        self.total = total

    def __enter__(self) -> Callable[[], None]:
        self.bar.__enter__()
        job = self.bar.add_task("runs", total=self.total)
        return lambda: self.bar.advance(job)

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(*exc)


def render_table(
    out: Out,
    title: str,
    header: Sequence[str],
    rows: Sequence[Sequence[str] | None],
    *,
    right: Sequence[bool],
) -> None:
    """Print a table: rich's where ``out`` is a rich Console, aligned text otherwise.

    ``rows`` holds cell texts (rich markup allowed); None starts a new section.
    ``right`` says, per column, whether it is right-aligned.
    """
    if not isinstance(out, PlainConsole):
        from rich.table import Table

        table = Table(title=title, header_style="bold", show_lines=False)
        for i, name in enumerate(header):
            if i == 0:
                table.add_column(name, style="cyan", no_wrap=True)
            else:
                table.add_column(name, justify="right" if right[i] else "left", no_wrap=i == 1)
        pending_section = False
        for row in rows:
            if row is None:
                pending_section = True
                continue
            if pending_section:
                table.add_section()
                pending_section = False
            table.add_row(*row)
        out.print(table)
        return
    plain = [[strip_markup(c) for c in row] if row is not None else None for row in rows]
    widths = [len(h) for h in header]
    for row in plain:
        if row is not None:
            widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        padded = (
            c.rjust(w) if right[i] else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )
        return "  ".join(padded).rstrip()

    out.print(title, markup=False)
    out.print(line(header), markup=False)
    out.print("  ".join("-" * w for w in widths), markup=False)
    for row in plain:
        out.print("" if row is None else line(row), markup=False)
