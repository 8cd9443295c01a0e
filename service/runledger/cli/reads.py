"""The operator's read commands: ``runledger list | show | workers | unknown`` (and
``events``, in :mod:`runledger.cli.events`).

Each prints a rich table on a terminal and, with ``--json``, one JSON document on
stdout (``events --follow --json``: one JSON object per line); logs and errors go to
stderr. Nothing here writes: every query runs in a read-only session
(:mod:`runledger.db.inspect`), and every time is judged by the database clock.
Registered on the ``runledger`` group by :mod:`runledger.cli`; errors are one line and
the exit codes of ``runledger --help`` there, as for every command.
"""

from __future__ import annotations

from typing import Any

import click

from runledger.cli.options import (
    CONTEXT,
    LIVENESS_RULE,
    connect_option,
    database_option,
    emit,
    json_option,
    limit_option,
    opt,
    reading,
    silent_option,
    since_option,
)
from runledger.cli.terminal import cells, line, new_console, new_table, print_table
from runledger.doctor import MAX_CLOCK_SKEW, offset_words
from runledger.model import RunStatus
from runledger.present import (
    age,
    ago,
    call_error,
    commands_for,
    compact,
    event_line,
    evidence_lines,
    expiry,
    when,
)

# -- list -------------------------------------------------------------------------------


@click.command("list", context_settings=CONTEXT)
@database_option
@connect_option
@opt(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice([str(s) for s in RunStatus]),
    help="Only runs in this status (repeatable; space-separated in the env var).",
)
@opt("--flow", default=None, help="Only runs of this flow: name, or name@version.")
@since_option
@limit_option(50, "runs")
@silent_option
@json_option
def list_runs(
    database_url: str | None,
    connect_timeout: float,
    statuses: tuple[str, ...],
    flow: str | None,
    since: Any,
    limit: int,
    lease_seconds: float,
    as_json: bool,
) -> None:
    """List runs, newest first (by when they were submitted).

    A running run's LEASE says 'live', 'expired, holder alive', or 'lease expired, no
    live worker' (its holder stopped or is silent: see `runledger workers`); the next
    worker of its flow to poll takes it over.
    """
    from runledger.db.inspect import list_runs as query

    if flow is not None and (not flow or flow.startswith("@") or flow.endswith("@")):
        raise click.BadParameter("give a name or name@version.", param_hint="'--flow'")
    with reading(database_url, connect_timeout) as conn:
        data = query(
            conn,
            statuses=statuses,
            flow=flow,
            since=since,
            limit=limit,
            silent_after=lease_seconds,
        )
    if as_json:
        emit(data, as_json=True)
        return
    console = new_console()
    if not data["runs"]:
        line(console, "no runs")
        return
    table = new_table(
        "run",
        "flow",
        "status",
        "token",
        "lease",
        "created",
        "waits for",
        whole=("run", "flow"),
    )
    for r in data["runs"]:
        lease = ""
        if r["status"] == "running":
            lease = f"{r['lease_owner']}: {expiry(r['expires_in_seconds'])}"
            if r["lease_state"] != "live":
                lease += ", " + r["lease_state"].removeprefix("lease expired, ").removeprefix(
                    "expired, "
                )
        table.add_row(
            *cells(
                r["run_id"],
                f"{r['flow']}@{r['flow_version']}",
                r["status"],
                r["fencing_token"],
                lease,
                ago(data["now"], r["created_at"]),
                _waits(r),
            )
        )
    print_table(console, table)
    if len(data["runs"]) == limit:
        line(console, f"(the newest {limit}; --limit for more)")


def _waits(r: dict[str, Any]) -> str:
    parts = []
    if r["unknown_calls"]:
        parts.append(f"{r['unknown_calls']} unknown")
    if r["awaiting_approval"]:
        parts.append(f"{r['awaiting_approval']} approval")
    return ", ".join(parts)


# -- show -------------------------------------------------------------------------------


@click.command(context_settings=CONTEXT, epilog="\b\n" + LIVENESS_RULE)
@database_option
@connect_option
@click.argument("run_id")
@silent_option
@json_option
def show(
    database_url: str | None,
    connect_timeout: float,
    run_id: str,
    lease_seconds: float,
    as_json: bool,
) -> None:
    """Show a run whole: its lease and holder, its turns with their calls, its timeline.

    The lease is judged by the database clock: 'live', 'expired, holder alive' (the
    holder is fenced at its next write), or 'lease expired, no live worker' (its holder
    stopped, is silent or unknown): the next worker of the flow to poll takes it over.
    Keys and commands are printed whole, whatever the terminal's width.
    """
    from runledger.db.inspect import TIMELINE_LIMIT, show_run

    with reading(database_url, connect_timeout) as conn:
        data = show_run(conn, run_id, silent_after=lease_seconds)
    if as_json:
        emit(data, as_json=True)
        return
    console = new_console()
    run, now = data["run"], data["now"]
    line(
        console,
        f"{run['run_id']} {run['flow']}@{run['flow_version']} {run['status']} "
        f"token={run['fencing_token']} state_version={run['state_version']} "
        f"claims={run['claims']}",
        "bold",
    )
    line(
        console,
        f"created {when(run['created_at'])} ({ago(now, run['created_at'])}), "
        f"updated {when(run['updated_at'])} ({ago(now, run['updated_at'])})"
        + (f", finished {when(run['finished_at'])}" if run["finished_at"] else ""),
    )
    lease = data["lease"]
    if lease is not None:
        line(
            console,
            f"lease: {lease['verdict']}: owner {lease['owner']}, token {lease['fencing_token']}, "
            f"lease id {lease['lease_id']}, {expiry(lease['expires_in_seconds'])} "
            f"(at {when(lease['expires_at'])}, database clock)",
        )
        holder = lease["holder"]
        if holder is None:
            line(console, f"  holder {lease['owner']}: no workers row")
        else:
            line(
                console,
                f"  holder {holder['worker_id']} ({holder['hostname']} pid {holder['pid']}): "
                f"{holder['liveness']}, last heartbeat {age(holder['heartbeat_age_seconds'])} ago",
            )
        if lease["expired"]:
            line(
                console,
                f"  the next worker of {run['flow']}@{run['flow_version']} to poll takes it over "
                "(`runledger workers` lists who is alive)",
            )
    if run["pause_reason"]:
        line(console, f"pause reason: {run['pause_reason']}")
    if run["error"] is not None:
        line(console, f"error: {compact(run['error'])}")
    if run["result"] is not None:
        line(console, f"result: {compact(run['result'])}")
    calls = [c for t in data["turns"] for c in t["calls"]]
    for turn in data["turns"]:
        line(
            console,
            f"turn {turn['turn']} (token {turn['fencing_token']}, {when(turn['created_at'])}): "
            f"{len(turn['calls'])} call(s)",
        )
        if turn["calls"]:
            table = new_table(
                "key",
                "tool",
                "status",
                "attempts",
                "by (token)",
                "receipt",
                "error",
                whole=("key",),
            )
            for c in turn["calls"]:
                status = c["status"] + (f" (approval {c['approval']})" if c["approval"] else "")
                by = f"{c['dispatched_by']} ({c['dispatched_token']})" if c["dispatched_by"] else ""
                table.add_row(
                    *cells(
                        c["idempotency_key"],
                        c["tool"],
                        status,
                        c["attempts"],
                        by,
                        compact(c["receipt"]),
                        call_error(c["error"]),
                    )
                )
            print_table(console, table)
    _print_actions(console, run["status"], calls)
    shown = len(data["timeline"])
    line(
        console,
        f"timeline: {shown} event(s)"
        + (
            f" (the newest {TIMELINE_LIMIT}; `runledger events --run` for all)"
            if data["timeline_truncated"]
            else ""
        ),
    )
    for e in data["timeline"]:
        line(console, "  " + event_line(e, run=False))


def _print_actions(console: Any, run_status: str, calls: list[dict[str, Any]]) -> None:
    unknown = [c for c in calls if c["status"] == "unknown"]
    awaiting = [c for c in calls if c["approval"] == "pending" and c["status"] == "planned"]
    if unknown:
        line(console, f"{len(unknown)} unknown call(s): check the provider, then run one of")
    for c in unknown:
        for step in evidence_lines(c["error"]):
            line(console, f"  {c['idempotency_key']} seen: {step}")
        lines, why = commands_for(c, run_status)
        for command in lines:
            line(console, "  " + command)
        if why:
            line(console, f"  {c['idempotency_key']}: {why}")
    if awaiting:
        line(console, f"{len(awaiting)} call(s) await approval: run one of the two lines for each")
    for c in awaiting:
        lines, why = commands_for(c, run_status)
        for command in lines:
            line(console, "  " + command)
        if why:
            line(console, f"  {c['idempotency_key']}: {why}")


# -- workers ----------------------------------------------------------------------------


@click.command(context_settings=CONTEXT, epilog="\b\n" + LIVENESS_RULE)
@database_option
@connect_option
@opt(
    "--liveness",
    "liveness",
    multiple=True,
    type=click.Choice(["alive", "silent", "stopped"]),
    help="Only workers in this state (repeatable).",
)
@limit_option(50, "workers")
@silent_option
@json_option
def workers(
    database_url: str | None,
    connect_timeout: float,
    liveness: tuple[str, ...],
    limit: int,
    lease_seconds: float,
    as_json: bool,
) -> None:
    """List workers: alive, silent or stopped, heartbeat age, runs held, host clock.

    RUNS HELD counts the running runs whose lease this worker holds and has not
    expired, by the database clock. CLOCK is how far the worker's host clock is from
    the database's, as the worker measured it (a worker judges every time by the
    database's clock; a host more than a second off is named in a warning). Alive
    first, then silent, then stopped.
    """
    from runledger.db.inspect import workers as query

    with reading(database_url, connect_timeout) as conn:
        data = query(conn, silent_after=lease_seconds, liveness=liveness, limit=limit)
    if as_json:
        emit(data, as_json=True)
        return
    console = new_console()
    if not data["workers"]:
        line(console, "no workers")
        return
    table = new_table(
        "worker",
        "host (pid)",
        "liveness",
        "heartbeat",
        "runs held",
        "clock",
        "flows",
        "started",
        whole=("worker", "flows"),
    )
    for w in data["workers"]:
        offset = w["clock_offset_seconds"]
        table.add_row(
            *cells(
                w["worker_id"],
                f"{w['hostname']} ({w['pid']})",
                w["liveness"],
                f"{age(w['heartbeat_age_seconds'])} ago",
                w["runs_held"],
                "-" if offset is None else f"{offset:+.3f} s",
                " ".join(w["flows"]),
                ago(data["now"], w["started_at"]),
            )
        )
    print_table(console, table)
    line(console, f"silent: no heartbeat for {lease_seconds:g} s (--lease-seconds)")
    for w in data["workers"]:
        offset = w["clock_offset_seconds"]
        if w["liveness"] == "alive" and offset is not None and abs(offset) > MAX_CLOCK_SKEW:
            line(
                console,
                f"warning: {w['worker_id']}'s {offset_words(offset)} (more than "
                f"{MAX_CLOCK_SKEW:g} s): check NTP on {w['hostname'] or 'its host'}",
            )


# -- unknown ----------------------------------------------------------------------------


@click.command(context_settings=CONTEXT)
@database_option
@connect_option
@opt(
    "--include-finished",
    is_flag=True,
    help="Also the calls of cancelled and failed runs (slower: reads every such run's calls).",
)
@limit_option(1000, "calls")
@json_option
def unknown(
    database_url: str | None,
    connect_timeout: float,
    include_finished: bool,
    limit: int,
    as_json: bool,
) -> None:
    """Every call waiting for a person: unknown calls and calls awaiting approval.

    Each with its run's status, tool, attempts, the token it was last dispatched under,
    who dispatched it, its error (why it waits, and the tool's exception: `--json` has it
    whole), and the exact command to run (`runledger resolve ...` for
    an unknown call once you know what the provider did; `runledger approve ...` or
    `runledger deny ...` for an approval). A call of a running run has no command yet:
    its worker pauses the run first. Oldest first.
    """
    from runledger.db.inspect import waiting_calls

    with reading(database_url, connect_timeout) as conn:
        data = waiting_calls(conn, include_finished=include_finished, limit=limit)
    for c in data["calls"]:
        lines, why = commands_for(c, c["run_status"])
        c["commands"] = lines
        c["note"] = why
    if as_json:
        emit(data, as_json=True)
        return
    console = new_console()
    if not data["calls"]:
        line(console, "no call is waiting for a person")
        return
    table = new_table(
        "key",
        "run status",
        "tool",
        "waits for",
        "attempts",
        "sent by (token)",
        whole=("key",),
    )
    for c in data["calls"]:
        table.add_row(
            *cells(
                c["idempotency_key"],
                c["run_status"],
                c["tool"],
                c["waits_for"],
                c["attempts"],
                f"{c['dispatched_by']} ({c['dispatched_token']})" if c["dispatched_by"] else "",
            )
        )
    print_table(console, table)
    line(console, "to act (check the provider first for an unknown call):")
    for c in data["calls"]:
        error = f" ({call_error(c['error'])})" if c["error"] is not None else ""
        line(console, f"  {c['idempotency_key']}{error}")
        for step in evidence_lines(c["error"]):
            line(console, "    seen: " + step)
        for command in c["commands"]:
            line(console, "    " + command)
        if c["note"]:
            line(console, f"    {c['note']}")
