"""Terminal output with rich when it is installed, plain text when it is not.

rich (and matplotlib, for ``--plot``) come with the ``tools`` extra. The
simulator's table, legend and conclusions need neither: without rich they are
printed as aligned plain text, so ``pip install kvproto`` alone gives a
working ``kvproto simulate``.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
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


PLAIN_EVERY_S = 30.0
"""Off a terminal (a CI log), a progress line at most this often: a long sweep shows it is alive."""


def progress(out: Out, total: int) -> AbstractContextManager[Callable[[], None]]:
    """Progress over ``total`` runs, on stderr so that stdout keeps only the report.

    On a terminal: rich's bar, or a counter redrawn in place without rich.
    Elsewhere: one line every :data:`PLAIN_EVERY_S` seconds.
    """
    if not sys.stderr.isatty():
        return _PlainProgress(total, redraw=False)
    if isinstance(out, PlainConsole):
        return _PlainProgress(total, redraw=True)
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
        console=Console(stderr=True),
        transient=True,
    )
    return _RichProgress(bar, total)


class _PlainProgress(AbstractContextManager[Callable[[], None]]):
    """``done/total runs`` on stderr: redrawn in place (a terminal) or a line now and then."""

    def __init__(self, total: int, *, redraw: bool) -> None:
        self.total = total
        self.redraw = redraw
        self.every = 0.1 if redraw else PLAIN_EVERY_S
        self.done = 0
        self.started = self.shown = time.monotonic()

    def __enter__(self) -> Callable[[], None]:
        return self.advance

    def advance(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.shown < self.every:
            return
        self.shown = now
        text = (
            f"{self.done:,}/{self.total:,} runs ({self.done / self.total:.0%}), "
            f"{now - self.started:.0f} s"
        )
        if self.redraw:
            sys.stderr.write(f"\r{text}")
        else:
            sys.stderr.write(f"kvproto simulate: {text}\n")
        sys.stderr.flush()

    def __exit__(self, *exc: object) -> None:
        if self.redraw and self.shown != self.started:
            sys.stderr.write("\r\x1b[K")  # the counter was transient: leave a clean line
            sys.stderr.flush()


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


class _ClosedPipeSafe:
    """A text stream that treats its reader going away as the end of the output.

    ``kvproto simulate | head -1``: once ``head`` has its line, writing raises
    BrokenPipeError. The command's work (and the files it writes) should not
    depend on who reads its report, so later output is dropped instead, and the
    stream's descriptor is pointed at the null device so that the interpreter's
    own flush at exit does not fail either.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._gone = False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self._gone = True
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._stream.fileno())
        finally:
            os.close(null)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def survive_closed_stdout() -> None:
    """Make ``sys.stdout`` drop what it cannot write once its reader has gone."""
    if not isinstance(sys.stdout, _ClosedPipeSafe):
        sys.stdout = cast(TextIO, _ClosedPipeSafe(sys.stdout))


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
