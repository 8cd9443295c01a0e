"""How the CLI lays out a table: no database, :mod:`runledger.cli_render` itself."""

from __future__ import annotations

import re
from io import StringIO
from typing import Any

import pytest
from rich.console import Console

from runledger.cli_render import _cells, _table, print_table

# -- tables: keys whole, no word broken, whatever the width ------------------------------

KEY = "ticket-77-with-a-rather-long-run-identifier-for-testing:0:c0"
ROWS = [
    (KEY, "create_ticket", "unknown", 3, "w1 (1)", '{"ticket_id": "T-1001"}',
     "retries exhausted: RuntimeError: ticket service exploded"),
    (KEY[:-1] + "1", "send_email", "planned", 0, "", "", ""),
]  # fmt: skip


def _render(width: int, printer: Any = print_table) -> str:
    out = StringIO()
    console = Console(file=out, width=width, highlight=False)
    table = _table(
        "key", "tool", "status", "attempts", "by (token)", "receipt", "error", whole=("key",)
    )
    for row in ROWS:
        table.add_row(*_cells(*row))
    printer(console, table)
    return out.getvalue()


def _cell_words(text: str) -> list[str]:
    """Each column's text of each table line, joined: the words a reader sees."""
    lines = [line for line in text.splitlines() if line.startswith(("│", "┃"))]
    columns = [[cell.strip() for cell in re.split("[│┃]", line)[1:-1]] for line in lines]
    return [word for row in columns for cell in row for word in cell.split()]


@pytest.mark.parametrize("width", [40, 80, 100, 120, 135, 160, 200, 400])
def test_a_table_keeps_keys_whole_and_breaks_no_word(width: int) -> None:
    text = _render(width)
    lines = text.splitlines()
    # each key whole on one line of the table
    assert any(f"│ {KEY} │" in line for line in lines), text
    assert any(f"│ {KEY[:-1]}1 │" in line for line in lines), text
    # every word of every cell and header is on one line, none cut
    words = set(_cell_words(text))
    for row in ROWS:
        for value in row:
            for word in str(value).split():
                assert word in words, (word, text)
    for header in ("key", "tool", "status", "attempts", "receipt", "error"):
        assert header in words, text
    # no wider than the console when the words fit in it; else as wide as they need
    widest = max(len(line) for line in lines)
    need = len(_render(1).splitlines()[0])  # the narrowest the table can be
    assert widest == max(need, min(width, len(_render(10_000).splitlines()[0]))), text


def test_rich_alone_breaks_words_where_print_table_does_not() -> None:
    """Why print_table exists: at 120 columns rich folds ``create_ticket`` and the error's
    words once the key takes its whole width."""
    words = set(_cell_words(_render(120, lambda console, table: console.print(table))))
    assert "create_ticket" not in words or "RuntimeError:" not in words
    assert {"create_ticket", "RuntimeError:"} <= set(_cell_words(_render(120)))
