"""``runledger prune``: retention. Deletes finished runs (succeeded, failed, cancelled)
older than a duration by the database clock, in batches of short transactions
(``prune_runs_v2``: oldest first, SKIP LOCKED), so workers never wait on it. Queued,
running and paused runs are never touched; events are kept unless ``--events``. Then,
with the same cutoff and batch, what runs leave behind (``prune_records``): the
checkpoints of the event chains and their heads (the heads that still pin a chain carried
into a new checkpoint), the records of pruned checkpoints and chains, workers gone since,
old commit guarantees. Registered on the ``runledger`` group by :mod:`runledger.cli`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import sys
import time
from typing import Any

import click

from runledger.cli.options import (
    CONTEXT,
    connect_option,
    database_option,
    emit,
    json_option,
    open_client,
    opt,
)
from runledger.db.results import PrunedRecords

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class DurationType(click.ParamType):  # type: ignore[type-arg]
    """``30d``, ``12h``, ``90m``, ``45s``: a positive duration of at most a hundred years."""

    name = "DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, dt.timedelta):
            return value
        text = str(value).strip()
        number, unit = text[:-1], text[-1:]
        try:
            amount = float(number)
        except ValueError:
            amount = float("nan")
        if unit not in _UNITS or not amount > 0 or amount * _UNITS[unit] > 100 * 365 * 86400:
            self.fail(f"{value!r} is not a duration such as 30d, 12h, 90m or 45s.", param, ctx)
        return dt.timedelta(seconds=amount * _UNITS[unit])


@click.command(context_settings=CONTEXT)
@database_option
@connect_option
@opt(
    "--older-than",
    "older_than",
    type=DurationType(),
    required=True,
    help="Delete the runs that finished longer ago than this, by the database clock "
    "(30d, 12h, 90m, 45s).",
)
@opt("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@opt(
    "--events",
    is_flag=True,
    help="Delete the runs' events too, and the events that earlier prunes kept, once older "
    "than --older-than (by default they are kept: the audit trail may be kept longer than "
    "the runs).",
)
@opt(
    "--batch",
    type=click.IntRange(1, 10000),
    default=1000,
    show_default=True,
    help="Runs per transaction; and checkpoint heads, records and workers per transaction.",
)
@json_option
def prune(
    database_url: str | None,
    connect_timeout: float,
    older_than: dt.timedelta,
    dry_run: bool,
    events: bool,
    batch: int,
    as_json: bool,
) -> None:
    """Delete finished runs (succeeded, failed, cancelled) older than --older-than, with
    their turns and calls, in batches that never block a worker. Queued, running and paused
    runs are never deleted. Then the records older than --older-than that runs leave
    behind: checkpoints of the event chains and their heads (a head that still pins a kept
    chain is carried into a new checkpoint, so audit still verifies it), records of pruned
    checkpoints and chains, workers gone since, old commit guarantees. --dry-run counts the
    runs only. Progress goes to stderr."""
    with open_client(database_url, connect_timeout) as client:
        before = client.prune_cutoff(older_than)
        if dry_run:
            count = client.prunable(before)
            if as_json:
                emit({"dry_run": True, "before": before, "runs": count}, as_json=True)
            else:
                click.echo(f"{count} finished run(s) finished before {before}: would be deleted")
            return
        deleted = batches = 0
        started = time.monotonic()
        while True:
            n = client.prune_batch(before, keep_events=not events, limit=batch)
            deleted += n
            batches += 1
            if batches % 50 == 0:
                print(f"pruned {deleted} run(s) so far", file=sys.stderr, flush=True)
            if n < batch:
                break
        records = PrunedRecords()
        record_batches = 0
        while True:
            got = client.prune_records(before, keep_events=not events, limit=batch)
            records += got
            record_batches += 1
            if record_batches % 50 == 0:
                print(
                    f"pruned {records.checkpoints} checkpoint(s) so far",
                    file=sys.stderr,
                    flush=True,
                )
            if not got.more:
                break
        seconds = round(time.monotonic() - started, 3)
    if as_json:
        emit(
            {
                "dry_run": False,
                "before": before,
                "runs": deleted,
                "batches": batches,
                "events_deleted": events,
                "records": dataclasses.asdict(records),
                "record_batches": record_batches,
                "seconds": seconds,
            },
            as_json=True,
        )
    else:
        kept = "deleted with them" if events else "kept"
        click.echo(
            f"pruned {deleted} run(s) that finished before {before} in {batches} "
            f"batch(es) ({seconds} s); their events {kept}"
        )
        gone = f", the events of {records.chains} run(s) pruned earlier" if events else ""
        click.echo(
            f"pruned {records.checkpoints} checkpoint(s) of the event chains made before "
            f"{before} with {records.heads} head(s) ({records.carried} still pinning a chain, "
            f"carried into a new checkpoint){gone}, {records.checkpoint_prunes} "
            f"pruned-checkpoint record(s), {records.chain_prunes} pruned-chain record(s), "
            f"{records.workers} worker(s) silent since then, {records.commit_guarantees} "
            f"commit guarantee(s), in {record_batches} batch(es)"
        )
