"""How the read commands and the console show a call's error (:mod:`runledger.present`),
and how the CLI lays out a table (:mod:`runledger.cli.terminal`): no database, the
functions themselves."""

from __future__ import annotations

import re
from io import StringIO
from typing import Any

import pytest
from rich.console import Console

from runledger.cli.terminal import cells, new_table, print_table
from runledger.db.decode import Undecodable
from runledger.present import ERROR_CHARS, call_error

# -- a call's error: why, then what the tool raised, on one line ---------------------------


@pytest.mark.parametrize(
    ("error", "shown"),
    [
        (None, ""),
        (  # an idempotent tool that raised on every attempt
            {
                "reason": "retries exhausted",
                "type": "RuntimeError",
                "message": "ticket service exploded",
            },
            "retries exhausted: RuntimeError: ticket service exploded",
        ),
        (  # a read_only tool that failed: no reason, the exception only
            {"type": "TimeoutError", "message": ""},
            "TimeoutError",
        ),
        (
            {"reason": "in flight when its worker stopped; unsafe to repeat", "attempts": 1},
            "in flight when its worker stopped; unsafe to repeat",
        ),
        (
            {"reason": "lookup failed", "type": "HTTPError", "message": "503\nService Unavailable"},
            "lookup failed: HTTPError: 503 Service Unavailable",
        ),
        (
            {"reason": "denied", "note": "too much", "actor": "cli:carol"},
            "denied: too much",
        ),
        ({"reason": "abandoned", "note": None}, "abandoned"),
        ({"reason": "card declined", "not_applied": True}, "card declined"),
        ({"code": 7}, '{"code": 7}'),  # written by hand: shown as it is
        ("plain text", "plain text"),
        (["a", 1], '["a", 1]'),
        (
            Undecodable(reason="nested too deeply for Python to decode", size=10007),
            "<undecodable JSON, 10007 bytes: nested too deeply for Python to decode>",
        ),
    ],
)
def test_a_calls_error_is_one_line_why_then_what_the_tool_raised(error: Any, shown: str) -> None:
    assert call_error(error) == shown


def test_a_long_error_is_cut_with_an_ellipsis() -> None:
    message = "upstream said: " + "x" * 3000  # the worker keeps 2,000 characters
    shown = call_error({"reason": "retries exhausted", "type": "HTTPError", "message": message})
    assert len(shown) == ERROR_CHARS
    assert shown.startswith("retries exhausted: HTTPError: upstream said: xxx")
    assert shown.endswith("x…")
    assert call_error({"type": "E", "message": "a\n\n  b\tc"}) == "E: a b c"


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
    table = new_table(
        "key", "tool", "status", "attempts", "by (token)", "receipt", "error", whole=("key",)
    )
    for row in ROWS:
        table.add_row(*cells(*row))
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


@pytest.mark.parametrize("width", [80, 10_000])
def test_a_cell_wider_than_the_console_keeps_the_key_whole(width: int) -> None:
    """A receipt of 15,000 characters with no space in it: the table is as wide as that
    word, whatever the console's width, and the key still on one line."""
    out = StringIO()
    console = Console(file=out, width=width, highlight=False)
    table = new_table("key", "tool", "receipt", whole=("key",))
    table.add_row(*cells(KEY, "create_ticket", "r" * 15_000))
    print_table(console, table)
    lines = out.getvalue().splitlines()
    assert any(line.startswith(f"│ {KEY} │ create_ticket │ rrr") for line in lines)
    assert all(line.endswith(("┓", "┃", "┩", "│", "┘")) for line in lines)  # none cropped
