"""A run from the outside: ``runledger submit``, ``status``, ``wait``, ``cancel`` and
``retry``, through :class:`runledger.client.Client`. Registered on the ``runledger``
group by :mod:`runledger.cli`; errors are one line and the exit codes of ``runledger
--help``, as for every command.
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from typing import Any

import click

from runledger import errors
from runledger.cli.exits import EXIT_FAILED, fail
from runledger.cli.options import (
    CONTEXT,
    FiniteFloatRange,
    actor_option,
    connect_option,
    database_option,
    emit,
    json_arg,
    json_option,
    open_client,
    opt,
)
from runledger.cli.terminal import cells, line, new_console, new_table, print_table
from runledger.present import (
    APPROVABLE,
    RESOLVABLE,
    approval_lines,
    call_error,
    resolve_command,
    shown_status,
)


def _traceparent(value: str | None) -> str | None:
    from runledger.db.validate import check_traceparent

    if value is not None:
        try:
            check_traceparent(value)
        except errors.InvalidInput as exc:
            raise click.BadParameter(f"{exc.message}: {exc.hint}.") from None
    return value


@click.command(context_settings=CONTEXT)
@database_option
@connect_option
@click.argument("flow")
@opt("--input", "input_json", default="{}", help="The run's input: a JSON object.")
@opt(
    "--run-id",
    default=None,
    help="Run id (default: generated; an empty one is refused). Resubmitting is a no-op.",
)
@opt("--priority", type=click.IntRange(-(2**31), 2**31 - 1), default=0, help="Higher runs first.")
@opt(
    "--traceparent",
    default=None,
    callback=lambda ctx, param, value: _traceparent(value),
    help="A W3C trace context (00-<trace id>-<parent id>-<flags>) the run's spans continue.",
)
@json_option
def submit(
    database_url: str | None,
    connect_timeout: float,
    flow: str,
    input_json: str,
    run_id: str | None,
    priority: int,
    traceparent: str | None,
    as_json: bool,
) -> None:
    """Submit a run of FLOW (name@version)."""
    payload = json_arg("--input", input_json, obj=True)
    if run_id is not None and not run_id:
        raise click.BadParameter(
            "must not be empty (leave it out to generate one).", param_hint="'--run-id'"
        )
    with open_client(database_url, connect_timeout) as client:
        name, version = client.resolve_flow(flow)
        ref = f"{name}@{version}"
        res = client.submit(ref, payload, run_id=run_id, priority=priority, traceparent=traceparent)
        if ref not in client.known_flows():  # after: a refused submit is its one line only
            click.echo(
                f"warning: no worker has registered {ref} yet; the run waits for one", err=True
            )
    if as_json:
        emit({"run_id": res.run_id, "created": res.created}, as_json=True)
    else:
        click.echo(f"{res.run_id} {'submitted' if res.created else 'already exists (no-op)'}")


def _value(value: Any) -> Any:
    """A field for output: JSON Python could not decode is its description, enums are words."""
    from runledger.db.decode import Undecodable

    if isinstance(value, Undecodable):
        return str(value)
    if isinstance(value, StrEnum):
        return str(value)
    return value


def _fields(obj: Any) -> dict[str, Any]:
    import dataclasses

    return {f.name: _value(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _run_dict(run: Any) -> dict[str, Any]:
    return _fields(run)


def _shown(value: Any) -> str:
    """A JSON value in a table cell: compact JSON, or the description of an undecodable one."""
    from runledger.db.decode import Undecodable

    if isinstance(value, Undecodable):
        return str(value)
    return json.dumps(value, default=str, ensure_ascii=False)


@click.command(context_settings=CONTEXT)
@database_option
@connect_option
@click.argument("run_id")
@json_option
def status(database_url: str | None, connect_timeout: float, run_id: str, as_json: bool) -> None:
    """Show a run and its calls.

    Idempotency keys and the pause reason are printed whole, whatever the terminal's
    width (piped, the table is as wide as its content); each call's error says why it
    failed or is unknown and what the tool raised (`--json` has it whole). For each
    unknown call of a paused (or cancelled, or failed) run, the `runledger resolve` line
    to run once you know what the provider did; for each call awaiting approval, the
    `runledger approve` and `runledger deny` lines.
    """
    with open_client(database_url, connect_timeout) as client:
        run = client.get(run_id)
        calls = client.calls(run_id)
    if as_json:
        emit({"run": _run_dict(run), "calls": [_fields(c) for c in calls]}, as_json=True)
        return
    from runledger.db.decode import Undecodable

    console = new_console()

    def out(text: str, style: str = "") -> None:
        line(console, text, style)  # never cut or folded by rich: a copy is whole

    out(
        f"{run.run_id} {run.flow}@{run.flow_version} {run.status} "
        f"token={run.fencing_token} state_version={run.state_version}",
        "bold",
    )
    if run.pause_reason:
        out(f"pause reason: {run.pause_reason}")
    for name in ("input", "state", "result", "error"):
        value = getattr(run, name)
        if isinstance(value, Undecodable):
            out(f"{name}: {value}")
    if calls:
        table = new_table(
            "key", "tool", "status", "attempts", "result", "receipt", "error", whole=("key",)
        )
        for c in calls:
            table.add_row(
                *cells(
                    c.idempotency_key,
                    c.tool,
                    shown_status(c),
                    c.attempts,
                    _shown(c.result),
                    _shown(c.receipt),
                    call_error(c.error),
                )
            )
        print_table(console, table)
    unknown = [c for c in calls if c.status == "unknown"]
    if unknown and run.status in RESOLVABLE:
        out(f"{len(unknown)} unknown call(s): check the provider, then run one of")
        for c in unknown:
            out("  " + resolve_command(c.idempotency_key))
    awaiting = [c for c in calls if c.approval == "pending" and c.status == "planned"]
    if awaiting and run.status in APPROVABLE:
        out(f"{len(awaiting)} call(s) await approval: run one of the two lines for each")
        for c in awaiting:
            for command in approval_lines(c.idempotency_key):
                out("  " + command)


@click.command(context_settings=CONTEXT)
@database_option
@connect_option
@click.argument("run_id")
@opt("--timeout", type=FiniteFloatRange(min=0), default=60.0, help="Seconds to wait.")
@json_option
def wait(
    database_url: str | None, connect_timeout: float, run_id: str, timeout: float, as_json: bool
) -> None:
    """Wait until a run succeeds, fails, is cancelled or pauses; exit 1 unless it succeeded."""
    with open_client(database_url, connect_timeout) as client:
        try:
            run = client.wait(run_id, timeout)
        except TimeoutError as exc:
            fail(f"error: {exc}", EXIT_FAILED)
    emit(_run_dict(run) if as_json else f"{run.run_id} {run.status}", as_json=as_json)
    sys.exit(0 if run.status == "succeeded" else 1)


@click.command(context_settings=CONTEXT)
@database_option
@connect_option
@click.argument("run_id")
@opt("--reason", default=None, help="Why; kept in the ledger.")
@actor_option
def cancel(
    database_url: str | None,
    connect_timeout: float,
    run_id: str,
    reason: str | None,
    actor: str | None,
) -> None:
    """Cancel a run; its current lease holder is refused from then on."""
    with open_client(database_url, connect_timeout, actor) as client:
        client.cancel(run_id, reason)
    click.echo(f"{run_id} cancelled")


@click.command(context_settings=CONTEXT)
@database_option
@connect_option
@click.argument("run_id")
@actor_option
def retry(database_url: str | None, connect_timeout: float, run_id: str, actor: str | None) -> None:
    """Put a failed or paused run back in the queue."""
    with open_client(database_url, connect_timeout, actor) as client:
        client.retry(run_id)
    click.echo(f"{run_id} queued")
