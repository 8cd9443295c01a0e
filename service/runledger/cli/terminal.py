"""What the read commands share: their options (``--since``, ``--limit``,
``--lease-seconds``), the read-only connection, and the terminal rendering (tables whose
cells fold, lines kept whole, times by the database clock). See :mod:`runledger.cli.reads`."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click

from runledger.cli.options import _database_url, _opt, setting_option

F = TypeVar("F", bound=Callable[..., Any])

LIVENESS_RULE = (
    "A worker heartbeats every third of its lease: it is 'stopped' when it said so on "
    "the way out, 'silent' when its last heartbeat (by the database clock) is "
    "--lease-seconds old or older (three missed heartbeats: no lease it held is still "
    "live), else 'alive'."
)

silent_option = setting_option(
    "lease_seconds",
    help="The workers' lease length (set it as the workers' RUNLEDGER_LEASE_SECONDS): "
    "a worker without a heartbeat for this long is silent.",
)


def limit_option(default: int, what: str) -> Callable[[F], F]:
    from runledger.db.inspect import MAX_LIMIT

    return _opt(
        "--limit",
        type=click.IntRange(1, MAX_LIMIT),
        default=default,
        help=f"At most this many {what}.",
    )


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|h|d)")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class SinceType(click.ParamType):  # type: ignore[type-arg]
    """``30m``, ``2h``, ``7d``, ``90s`` (before the database's now), or an ISO 8601
    timestamp (without a zone: UTC)."""

    name = "DURATION|TIMESTAMP"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from runledger.db.inspect import Since

        if isinstance(value, Since):
            return value
        text = str(value).strip()
        m = _DURATION.fullmatch(text)
        if m:
            seconds = float(m.group(1)) * _UNITS[m.group(2)]
            if seconds > 100 * 365 * 86400:
                self.fail(f"{value!r} is more than a hundred years.", param, ctx)
            return Since(ago=dt.timedelta(seconds=seconds))
        try:
            at = dt.datetime.fromisoformat(text)
        except ValueError:
            self.fail(
                f"{value!r} is neither a duration (30m, 2h, 7d) nor an ISO timestamp "
                "(2026-12-01T15:00:00Z).",
                param,
                ctx,
            )
        if at.tzinfo is None:
            at = at.replace(tzinfo=dt.UTC)
        return Since(at=at)


since_option = _opt(
    "--since",
    type=SinceType(),
    default=None,
    help="Only since then: a duration before the database's now (30m, 2h, 7d) or an "
    "ISO timestamp (UTC unless it says).",
)


@contextmanager
def _reading(database_url: str | None, connect_timeout: float) -> Iterator[Any]:
    from runledger.db.execution import probe_blocking
    from runledger.db.inspect import read_connection

    url = _database_url(database_url)
    # unreachable, no schema, an older schema: the one-line errors every command gives
    probe_blocking(url, timeout=connect_timeout, application_name="runledger-cli")
    with read_connection(url, connect_timeout) as conn:
        yield conn


# when stdout is not a terminal and COLUMNS is not set: wide enough for any table
PIPE_WIDTH = 10_000


def _console(*, broken_pipe_raises: bool = False) -> Any:
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


def _line(console: Any, text: str, style: str = "") -> None:
    from rich.text import Text

    # soft_wrap: never cut or folded by rich; the terminal wraps it, a copy is whole
    console.print(Text(text, style=style), soft_wrap=True)


def _table(*headers: str, whole: tuple[str, ...] = ()) -> Any:
    """A table whose cells fold, never cut with an ellipsis; the ``whole`` columns (keys,
    run ids) are kept on one line. Print it with :func:`print_table`."""
    from rich.table import Table

    table = Table()
    for header in headers:
        table.add_column(header, overflow="fold", no_wrap=header in whole)
    return table


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
        lines = [line for text in texts for line in text.splitlines()] or [""]
        highs.append(max(cell_len(line) for line in lines))
        words = [cell_len(word) for line in lines for word in line.split()]
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


def when(at: str | None) -> str:
    """An ISO time, shorter: ``2026-12-01 15:23:15.463Z`` (UTC)."""
    if at is None:
        return ""
    t = dt.datetime.fromisoformat(at).astimezone(dt.UTC)
    return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def _cells(*values: Any) -> list[Any]:
    from rich.text import Text

    return [Text("" if v is None else str(v)) for v in values]


def age(seconds: float | None) -> str:
    """``42s``, ``3m 5s``, ``2h 10m``, ``3d 4h``."""
    if seconds is None:
        return ""
    s = int(abs(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def _ago(now: str, at: str | None) -> str:
    if at is None:
        return ""
    delta = dt.datetime.fromisoformat(now) - dt.datetime.fromisoformat(at)
    return age(delta.total_seconds()) + " ago"


def _expiry(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"expires in {age(seconds)}" if seconds > 0 else f"expired {age(seconds)} ago"


def _compact(value: Any) -> str:
    return "" if value is None else json.dumps(value, default=str, ensure_ascii=False)


ERROR_CHARS = 200  # a call's error in a table, a line or a page; --json has it whole


def call_error(error: Any, limit: int = ERROR_CHARS) -> str:
    """A call's error on one line, for the person who must decide what to do with it:
    why (its ``reason``), then the tool's exception (``type: message``), then a person's
    ``note``: ``retries exhausted: RuntimeError: ticket service exploded``. Whitespace
    is collapsed and the text cut at ``limit`` characters with an ellipsis."""
    if error is None:
        return ""
    if isinstance(error, dict):
        parts = [] if error.get("reason") in (None, "") else [str(error["reason"])]
        kind, message = error.get("type"), error.get("message")
        if kind not in (None, ""):
            parts.append(f"{kind}: {message}" if message not in (None, "") else str(kind))
        elif message not in (None, ""):
            parts.append(str(message))
        if error.get("note") not in (None, ""):
            parts.append(str(error["note"]))
        text = ": ".join(parts) if parts else _compact(error)
    elif isinstance(error, list | int | float | bool):
        text = _compact(error)
    else:  # a string as it is; JSON Python could not decode, described
        text = str(error)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def _event_line(e: dict[str, Any], *, run: bool = True) -> str:
    """``#12 2026-12-01 15:23:15.464Z ticket-77 claimed by worker-a token=1 lease_id=...``:
    the detail as key=value pairs, each value whole."""
    token = f" token={e['fencing_token']}" if e["fencing_token"] is not None else ""
    actor = f" by {e['actor']}" if e["actor"] else ""
    detail = e["detail"]
    if isinstance(detail, dict):
        pairs = " ".join(
            f"{k}={v if isinstance(v, str) and v and ' ' not in v else _compact(v)}"
            for k, v in detail.items()
        )
    else:
        pairs = _compact(detail)
    where = f" {e['run_id']}" if run else ""
    return f"#{e['event_id']} {when(e['at'])}{where} {e['kind']}{actor}{token}" + (
        f" {pairs}" if pairs else ""
    )
