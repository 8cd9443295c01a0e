"""How the CLI prints to a terminal (rich): tables whose cells fold and never break a
word, lines kept whole whatever the width, and the width of a pipe. What the text says
(times, errors, events) is :mod:`runledger.present`'s, shared with the console."""

from __future__ import annotations

import os
from typing import Any

# when stdout is not a terminal and COLUMNS is not set: wide enough for any table
PIPE_WIDTH = 10_000


def new_console(*, broken_pipe_raises: bool = False) -> Any:
    """A rich console; with ``broken_pipe_raises``, a reader that went away is
    ``BrokenPipeError`` for the caller to end on (rich's own answer is exit 1).

    On a terminal it is the terminal's width (or ``COLUMNS``). Piped or redirected
    without ``COLUMNS``, rich would assume 80 columns and fold keys across lines, or
    squeeze the other columns to nothing: there the tables take the width of their
    content instead, a row per line, every key whole to copy."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            if broken_pipe_raises:
                raise BrokenPipeError
            super().on_broken_pipe()

    console = _Console(highlight=False)
    if not console.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
        console.width = PIPE_WIDTH
    return console


def line(console: Any, text: str, style: str = "") -> None:
    """``text`` on ``console`` as it is: rich neither reads markup in it nor cuts it."""
    from rich.text import Text

    # soft_wrap: never cut or folded by rich; the terminal wraps it, a copy is whole
    console.print(Text(text, style=style), soft_wrap=True)


def new_table(*headers: str, whole: tuple[str, ...] = ()) -> Any:
    """A table whose cells fold, never cut with an ellipsis; the ``whole`` columns (keys,
    run ids) are kept on one line. Print it with :func:`print_table`."""
    from rich.table import Table

    table = Table()
    for header in headers:
        table.add_column(header, overflow="fold", no_wrap=header in whole)
    return table


def cells(*values: Any) -> list[Any]:
    """A table row's cells as plain text (``None`` blank): rich markup is not read."""
    from rich.text import Text

    return [Text("" if v is None else str(v)) for v in values]


def print_table(console: Any, table: Any) -> None:
    """Print ``table`` with no cell broken inside a word and every ``whole`` column on one
    line. rich, given less width than a table's content, narrows its widest columns
    first, but down to a letter or two whatever their words (``create_ticket`` as
    ``create`` / ``_ticke`` / ``t``) once a whole column took its share. Here the widest
    columns are narrowed first too, each no further than its longest word (a whole
    column not at all). When even that is wider than the console, the table is printed
    that wide: the terminal wraps its lines, and a key copied from it is whole."""
    from rich.cells import cell_len
    from rich.measure import Measurement

    lows, highs = [], []
    for column in table.columns:
        texts = [str(getattr(cell, "plain", cell)) for cell in (column.header, *column.cells)]
        lines = [row for text in texts for row in text.splitlines()] or [""]
        highs.append(max(cell_len(row) for row in lines))
        words = [cell_len(word) for row in lines for word in row.split()]
        lows.append(highs[-1] if column.no_wrap else max(words, default=0))
    # borders and padding: the table's natural width past its content's (measured with
    # room to spare, so that a cell wider than the console is not capped)
    bound = sum(highs) + 8 * (len(highs) + 1)
    natural = Measurement.get(console, console.options.update(max_width=bound), table)
    overhead = natural.maximum - sum(highs)
    room = console.width - overhead
    if sum(highs) <= room:  # it fits as it is
        console.print(table)
        return

    def capped(cap: int) -> list[int]:
        return [min(high, max(low, cap)) for low, high in zip(lows, highs, strict=True)]

    below, above = 0, max(highs)  # the widest cap that fits: binary search
    while below < above:
        middle = (below + above + 1) // 2
        below, above = (middle, above) if sum(capped(middle)) <= room else (below, middle - 1)
    widths = capped(below)
    for i, high in enumerate(highs):  # what the cap left, a column each
        if sum(widths) < room and widths[i] < high:
            widths[i] += 1
    for column, width in zip(table.columns, widths, strict=True):
        column.width = max(width, 1)
    saved = console.width
    console.width = max(saved, sum(widths) + overhead)
    try:
        console.print(table)
    finally:
        console.width = saved
