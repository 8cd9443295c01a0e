"""``runledger events``: the event log (``run_timeline``), newest last; ``--follow`` tails
it until Ctrl-C. Registered on the ``runledger`` group by :mod:`runledger.cli`."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import click

from runledger.cli.options import (
    CONTEXT,
    connect_option,
    database_option,
    emit,
    limit_option,
    opt,
    reading,
    since_option,
)
from runledger.cli.terminal import line, new_console
from runledger.present import event_line

POLL_SECONDS = 0.5


@click.command(context_settings=CONTEXT)
@database_option
@connect_option
@opt("--run", "run_id", default=None, help="Only the events of this run.")
@opt("--kind", "kinds", multiple=True, help="Only events of this kind (repeatable).")
@since_option
@limit_option(50, "events (the newest; --follow then prints every new one)")
@opt(
    "--follow",
    is_flag=True,
    help="Keep printing new events (polled every 0.5 s) until Ctrl-C (exit 0).",
)
@opt(
    "--json",
    "as_json",
    is_flag=True,
    help="Machine-readable: one JSON document; with --follow one JSON object per line.",
)
def events(
    database_url: str | None,
    connect_timeout: float,
    run_id: str | None,
    kinds: tuple[str, ...],
    since: Any,
    limit: int,
    follow: bool,
    as_json: bool,
) -> None:
    """Print events, newest last (the newest --limit of them), from run_timeline."""
    from runledger.db.event_log import EventFollower, last_event_id
    from runledger.db.event_log import events as query

    with reading(database_url, connect_timeout) as conn:
        top = last_event_id(conn)
        rows = query(conn, run_id=run_id, kinds=kinds, since=since, limit=limit, until=top)
        if as_json and not follow:
            emit({"events": rows}, as_json=True)
            return
        console = None if as_json else new_console(broken_pipe_raises=True)

        def out(batch: list[dict[str, Any]]) -> None:
            for e in batch:
                if console is None:
                    click.echo(json.dumps(e, default=str, sort_keys=True))
                else:
                    line(console, event_line(e))
            sys.stdout.flush()  # a pipe is block-buffered: each poll's events go out now

        if not rows and console is not None and not follow:
            line(console, "no events")
        if not follow:
            out(rows)
            return
        # Ctrl-C ends the follow however the command was started: a background job of a
        # script inherits SIGINT ignored, and Python then raises no KeyboardInterrupt
        # (the worker and the console install their own handlers, too)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            out(rows)
            follower = EventFollower(conn, after=top, run_id=run_id, kinds=kinds)
            while True:
                time.sleep(POLL_SECONDS)
                out(follower.poll())
        except KeyboardInterrupt:  # Ctrl-C: the way to stop following, exit 0
            return
        except BrokenPipeError:  # `runledger events --follow | head`: the reader left
            # stdout is gone: point it at /dev/null so the interpreter's final flush is quiet
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return
