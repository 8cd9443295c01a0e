"""The ``runledger`` command (``python -m runledger`` is the same).

Data goes to stdout, logs to stderr. Every failure is one line on stderr that starts
``error: `` (click's own usage errors included), never a traceback, and its exit code
says what kind it is (:data:`EXIT_CODES`, shown by ``runledger --help``): 0 ok; 1 a
check failed, a run did not succeed, or the database refused the request (a write on a
standby: ``ReadOnly``); 2 usage (a bad option, argument or value, input that is not JSON
or nests too deeply, no or a malformed database URL); 3 the database is unavailable or
has no (or an older) runledger schema, or is a standby under ``runledger worker``, which
only writes. :func:`run` maps the exceptions onto them.

One environment rule for every option of every command: ``--some-option`` reads
``RUNLEDGER_SOME_OPTION`` (``--database-url`` then falls back to ``DATABASE_URL``), and
``--help`` shows it. The variables are set on each option explicitly (:func:`_opt`), never
derived by click from parameter names. ``--json`` reads ``RUNLEDGER_JSON`` and nothing else.

The worker's options are generated from :class:`runledger.config.Settings` (name, type,
default, range, help), so each setting has exactly one range; the command builds a
``Settings`` from them and makes the worker with ``worker_from_settings``.
"""

from __future__ import annotations

import json
import os
import sys
from enum import StrEnum
from typing import Any, NoReturn

import click

from runledger import errors
from runledger.cli_approvals import (
    APPROVABLE,
    actor_option,
    approval_lines,
    approve,
    deny,
    shown_status,
)
from runledger.cli_audit import audit, checkpoint
from runledger.cli_console import console
from runledger.cli_doctor import doctor
from runledger.cli_events import events
from runledger.cli_options import (
    CONTEXT,
    FiniteFloatRange,
    _client,
    _database_url,
    _joined,
    _json_arg,
    _one_line,
    _opt,
    _settings_options,
    build_settings,
    connect_option,
    database_option,
    emit,
    json_option,
)
from runledger.cli_prune import prune
from runledger.cli_reads import list_runs, show, unknown, workers
from runledger.config import (
    with_connect_timeout,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3
EXIT_CODES = {
    EXIT_OK: "ok",
    EXIT_FAILED: "a check failed, a run did not succeed, or the database refused (a write "
    "on a standby too)",
    EXIT_USAGE: "usage: a bad option, value or JSON; no or a malformed database URL; a "
    "--flows module that does not import",
    EXIT_UNAVAILABLE: "database unreachable, its runledger schema missing or behind, or a "
    "standby (worker)",
}


def _exit_codes_help() -> str:
    return "\n".join(f"  {code}  {what}" for code, what in EXIT_CODES.items())


@click.group(
    context_settings=CONTEXT,
    epilog="\b\nExit codes (every error is one line on stderr):\n" + _exit_codes_help(),
)
@click.version_option(package_name="runledger-pg")
def main() -> None:
    """runledger: durable, fenced AI-agent runs on PostgreSQL."""


@main.command(context_settings=CONTEXT)
@database_option
@connect_option
@_opt("--sql", "sql_only", is_flag=True, help="Print the SQL; do not connect.")
@_opt("--check", is_flag=True, help="Exit 1 when the database is behind; change nothing.")
@_opt("--revision", default="head", help="Target revision.")
def migrate(
    database_url: str | None,
    connect_timeout: float,
    sql_only: bool,
    check: bool,
    revision: str,
) -> None:
    """Upgrade the runledger schema (safe to run from several processes at once).

    The database must exist (`createdb NAME` first); a database that cannot be reached
    is one line and exit 3.
    """
    from runledger.db import migrate as m

    if sql_only:
        click.echo(m.offline_sql(revision), nl=False)
        return
    url = _database_url(database_url)
    m.check_reachable(url, connect_timeout, upgrade=not check)
    if check:
        current, head = m.current(url), m.head()
        if current != head:
            state = "behind" if current is None or m.known(current) else "unknown to this code"
            click.echo(f"{state}: database at {current or 'nothing'}, code at {head}", err=True)
            sys.exit(1)
        click.echo(f"up to date: {head}")
        return
    before = m.current(url)
    m.upgrade(url, revision)
    after = m.current(url)
    click.echo(f"migrated: {before or 'empty'} -> {after}")


@main.command(context_settings=CONTEXT)
@_opt(
    "--flows",
    "flow_specs",
    multiple=True,
    required=True,
    help="package.module:attribute holding a Flow or a list of Flows "
    "(repeatable; space-separated in the env var).",
)
@_settings_options
@click.pass_context
def worker(ctx: click.Context, /, flow_specs: tuple[str, ...], **values: Any) -> None:
    """Run a worker process: claim runs of the given flows and drive them."""
    from runledger.worker import (
        configure_logging,
        event_loop_runner,
        load_flows,
        run_worker,
        worker_from_settings,
    )

    settings = build_settings(ctx, values)
    configure_logging(settings.log_level, settings.log_json)
    url = _database_url(settings.database_url)  # no URL: a usage error before importing flows
    # Every connection the worker makes (the pool's, the listener's) gets the timeout.
    try:
        url = with_connect_timeout(url, settings.connect_timeout)
    except Exception as exc:  # not a URL: the one-line ConfigurationError of Store.connect
        from runledger.db.execution import connect_error

        raise connect_error(exc, url, None) from None
    settings = settings.model_copy(update={"database_url": url})
    if settings.otel or settings.otel_file:
        _configure_otel(settings.otel_file)
    if settings.http_port is not None:
        import importlib.util

        from runledger.worker.metrics import INSTALL_HINT

        if importlib.util.find_spec("prometheus_client") is None:
            raise click.UsageError(INSTALL_HINT)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        w = worker_from_settings(settings, load_flows(flow_specs))
        event_loop_runner(settings.event_loop)  # uvloop asked for but missing: one line
    except (ValueError, ImportError) as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        run_worker(w, settings.event_loop)
    except errors.ReadOnly as exc:
        # a worker only writes: on a standby it can do nothing at all, as on a database it
        # cannot reach (exit 3, which a supervisor restarts on), not a refused request
        _fail(
            f"error: ReadOnly: {_one_line(exc)}; a worker needs the primary: list every "
            "host with target_session_attrs=read-write (docs/failover.md)",
            EXIT_UNAVAILABLE,
        )


def _configure_otel(file: str | None) -> None:
    """``--otel``: the SDK's TracerProvider for this process (runledger.worker.otel)."""
    from runledger.worker.tracing import INSTALL_HINT

    try:
        from runledger.worker import otel
    except ImportError:
        raise click.UsageError(INSTALL_HINT) from None
    try:
        otel.configure(file)
    except (otel.ExporterNotFound, OSError) as exc:
        raise click.UsageError(str(exc)) from None


def _traceparent(value: str | None) -> str | None:
    from runledger.db.validate import check_traceparent

    if value is not None:
        try:
            check_traceparent(value)
        except errors.InvalidInput as exc:
            raise click.BadParameter(f"{exc.message}: {exc.hint}.") from None
    return value


@main.command(context_settings=CONTEXT)
@database_option
@connect_option
@click.argument("flow")
@_opt("--input", "input_json", default="{}", help="The run's input: a JSON object.")
@_opt(
    "--run-id",
    default=None,
    help="Run id (default: generated; an empty one is refused). Resubmitting is a no-op.",
)
@_opt("--priority", type=click.IntRange(-(2**31), 2**31 - 1), default=0, help="Higher runs first.")
@_opt(
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
    payload = _json_arg("--input", input_json, obj=True)
    if run_id is not None and not run_id:
        raise click.BadParameter(
            "must not be empty (leave it out to generate one).", param_hint="'--run-id'"
        )
    with _client(database_url, connect_timeout) as client:
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


RESOLVABLE = ("paused", "cancelled", "failed")  # the run states resolve_call accepts


def resolve_command(key: str) -> str:
    """The line an operator runs for an unknown call (printed whole by ``status``)."""
    return f"runledger resolve {key} applied|not_applied|abandoned"


@main.command(context_settings=CONTEXT)
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
    with _client(database_url, connect_timeout) as client:
        run = client.get(run_id)
        calls = client.calls(run_id)
    if as_json:
        emit({"run": _run_dict(run), "calls": [_fields(c) for c in calls]}, as_json=True)
        return
    from runledger.cli_render import (
        _cells,
        _console,
        _line,
        _table,
        call_error,
        print_table,
    )
    from runledger.db.decode import Undecodable

    console = _console()

    def line(text: str, style: str = "") -> None:
        _line(console, text, style)  # never cut or folded by rich: a copy is whole

    line(
        f"{run.run_id} {run.flow}@{run.flow_version} {run.status} "
        f"token={run.fencing_token} state_version={run.state_version}",
        "bold",
    )
    if run.pause_reason:
        line(f"pause reason: {run.pause_reason}")
    for name in ("input", "state", "result", "error"):
        value = getattr(run, name)
        if isinstance(value, Undecodable):
            line(f"{name}: {value}")
    if calls:
        table = _table(
            "key", "tool", "status", "attempts", "result", "receipt", "error", whole=("key",)
        )
        for c in calls:
            table.add_row(
                *_cells(
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
        line(f"{len(unknown)} unknown call(s): check the provider, then run one of")
        for c in unknown:
            line("  " + resolve_command(c.idempotency_key))
    awaiting = [c for c in calls if c.approval == "pending" and c.status == "planned"]
    if awaiting and run.status in APPROVABLE:
        line(f"{len(awaiting)} call(s) await approval: run one of the two lines for each")
        for c in awaiting:
            for command in approval_lines(c.idempotency_key):
                line("  " + command)


@main.command(context_settings=CONTEXT)
@database_option
@connect_option
@click.argument("run_id")
@_opt("--timeout", type=FiniteFloatRange(min=0), default=60.0, help="Seconds to wait.")
@json_option
def wait(
    database_url: str | None, connect_timeout: float, run_id: str, timeout: float, as_json: bool
) -> None:
    """Wait until a run succeeds, fails, is cancelled or pauses; exit 1 unless it succeeded."""
    with _client(database_url, connect_timeout) as client:
        try:
            run = client.wait(run_id, timeout)
        except TimeoutError as exc:
            _fail(f"error: {exc}", EXIT_FAILED)
    emit(_run_dict(run) if as_json else f"{run.run_id} {run.status}", as_json=as_json)
    sys.exit(0 if run.status == "succeeded" else 1)


RESOLUTIONS = {
    "applied": (
        "the effect happened",
        "succeeded, result = --receipt ({} without one); never sent again",
        "the call succeeded, with that result",
    ),
    "not_applied": (
        "the effect did not happen",
        "planned; sent again under the same idempotency key",
        "the outcome of that new attempt",
    ),
    "abandoned": (
        "give up on the call, effect or not",
        "failed, error {reason: abandoned, note}; never sent again",
        "a failed call: a policy that ends on any history\n                 makes the run SUCCEED",
    ),
}


def _resolutions_help() -> str:
    rows = []
    for word, (means, call, policy) in RESOLUTIONS.items():
        rows.append(f"  {word}: {means}\n    call:        {call}\n    policy sees: {policy}")
    return "\n".join(rows)


RESOLVE_EPILOG = (
    "\b\nWhat each RESOLUTION does:\n"
    + _resolutions_help()
    + "\n\n\b\nThe run: a paused run with no unknown call left is queued again, and its"
    "\npolicy decides the next turn from the history above. A cancelled or failed"
    "\nrun stays as it is: only the call (the ledger) changes."
)


@main.command(context_settings=CONTEXT, epilog=RESOLVE_EPILOG)
@database_option
@connect_option
@click.argument("key")
@click.argument("resolution", type=click.Choice(list(RESOLUTIONS)))
@_opt("--receipt", default=None, help="Provider receipt (JSON object) for 'applied'.")
@_opt("--note", default=None, help="Why; kept in the ledger.")
@actor_option
def resolve(
    database_url: str | None,
    connect_timeout: float,
    key: str,
    resolution: str,
    receipt: str | None,
    note: str | None,
    actor: str | None,
) -> None:
    """Resolve an unknown call (KEY is its idempotency key, as `runledger status` shows it)."""
    receipt_obj = _json_arg("--receipt", receipt, obj=True) if receipt else None
    with _client(database_url, connect_timeout, actor) as client:
        client.resolve(key, resolution, receipt_obj, note)
    click.echo(f"{key} resolved as {resolution}")


main.add_command(approve)
main.add_command(deny)
main.add_command(doctor)
main.add_command(list_runs)
main.add_command(show)
main.add_command(workers)
main.add_command(unknown)
main.add_command(events)
main.add_command(prune)
main.add_command(audit)
main.add_command(checkpoint)
main.add_command(console)


@main.command(context_settings=CONTEXT)
@database_option
@connect_option
@click.argument("run_id")
@_opt("--reason", default=None, help="Why; kept in the ledger.")
@actor_option
def cancel(
    database_url: str | None,
    connect_timeout: float,
    run_id: str,
    reason: str | None,
    actor: str | None,
) -> None:
    """Cancel a run; its current lease holder is refused from then on."""
    with _client(database_url, connect_timeout, actor) as client:
        client.cancel(run_id, reason)
    click.echo(f"{run_id} cancelled")


@main.command(context_settings=CONTEXT)
@database_option
@connect_option
@click.argument("run_id")
@actor_option
def retry(database_url: str | None, connect_timeout: float, run_id: str, actor: str | None) -> None:
    """Put a failed or paused run back in the queue."""
    with _client(database_url, connect_timeout, actor) as client:
        client.retry(run_id)
    click.echo(f"{run_id} queued")


@main.command(context_settings=CONTEXT)
@_opt(
    "--database-url",
    envvar=None,  # the demo migrates and writes into it: never one taken from the environment
    default=None,
    help="Run the demo in this database (it migrates it and leaves its runs there); "
    "default: a throwaway cluster. Never read from RUNLEDGER_DATABASE_URL or DATABASE_URL.",
)
@_opt("--runs", type=click.IntRange(1, 10000), default=40, help="Runs to submit.")
@_opt("--workers", "n_workers", type=click.IntRange(1, 32), default=3, help="Worker processes.")
@_opt(
    "--kills",
    type=click.IntRange(0, 100),
    default=3,
    help="SIGKILLs, each while a call is in flight: an email, a ticket, a charge, an email...",
)
@_opt("--seed", type=int, default=7, help="Picks the customers, orders and amounts.")
@_opt(
    "--keep",
    is_flag=True,
    help="Leave the throwaway cluster and the demo's provider running and print how to "
    "connect, resolve and finish the paused runs.",
)
@_opt(
    "--stop",
    "stop_dir",
    default=None,
    metavar="DIR",
    help="Stop and remove a cluster (and its provider) an earlier `demo --keep` left "
    "running; nothing else.",
)
def demo(
    database_url: str | None,
    runs: int,
    n_workers: int,
    kills: int,
    seed: int,
    keep: bool,
    stop_dir: str | None,
) -> None:
    """Run the demo: a Pydantic AI agent's runs, workers SIGKILLed mid-call, an audit.

    Exit 0 when the audit holds (no effect twice, no succeeded call without its effect,
    every run succeeded or paused on an unknown call), 1 otherwise.
    """
    from runledger.demo.cluster import BadClusterDir, DemoError, NoDemoDatabase, stop_cluster

    try:
        if stop_dir is not None:
            stop_cluster(stop_dir)
            click.echo(f"stopped and removed {stop_dir}")
            return
        from runledger.demo.run import DemoOptions, run_demo

        options = DemoOptions(
            database_url=database_url,
            runs=runs,
            workers=n_workers,
            kills=kills,
            seed=seed,
            keep=keep,
        )
        code = run_demo(options)
    except BadClusterDir as exc:
        raise click.BadParameter(str(exc), param_hint="'--stop'") from None
    except NoDemoDatabase as exc:  # each source tried on a line of its own, no traceback
        _fail(f"error: {exc}", EXIT_FAILED)
    except DemoError as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(code)


@main.command(context_settings=CONTEXT)
@click.argument("directory", metavar="DIR", type=click.Path())
def init(directory: str) -> None:
    """Write a starter project into DIR: a flow with an idempotent and an unsafe tool, its
    pytest test that SIGKILLs a worker mid-call, and a README.

    DIR must be new or empty: otherwise exit 2, and nothing is written.
    """
    from runledger.starter import write_project

    try:
        written = write_project(directory)
    except errors.DirectoryNotEmpty as exc:
        raise click.BadParameter(str(exc), param_hint="'DIR'") from None
    click.echo(f"wrote {', '.join(p.name for p in written)} in {directory}")
    click.echo(f"next: cd {directory} && pip install 'runledger-pg[testing]' && pytest")


def _fail(message: str, code: int) -> NoReturn:
    """``message`` on stderr (an error starts ``error: ``, as everywhere), then exit."""
    click.echo(message, err=True)
    sys.exit(code)


def run() -> None:
    """The entry point: every error is one line on stderr and an exit code of EXIT_CODES.

    Usage errors (click's, and a malformed or missing URL: ``ConfigurationError``) exit 2;
    a database that cannot be reached or has no (or an older) schema exits 3; any other
    runledger error (a refusal by the database or the store, a standby's ``ReadOnly``
    included: the worker command exits 3 for that one itself) exits 1.
    """
    try:
        main(standalone_mode=False)
    except click.exceptions.Abort:
        _fail("aborted", EXIT_FAILED)
    except click.exceptions.NoArgsIsHelpError as exc:  # `runledger` alone: the help, as click
        exc.show()
        sys.exit(EXIT_USAGE)
    except click.UsageError as exc:  # lowercase, as every other error (click says "Error:")
        _fail(f"error: {_joined(exc.format_message())}", EXIT_USAGE)
    except click.ClickException as exc:
        _fail(f"error: {_joined(exc.format_message())}", exc.exit_code)
    except errors.ConfigurationError as exc:
        _fail(f"error: ConfigurationError: {_one_line(exc)}", EXIT_USAGE)
    except (errors.DatabaseUnavailable, errors.SchemaMissing) as exc:
        _fail(f"error: {type(exc).__name__}: {_one_line(exc)}", EXIT_UNAVAILABLE)
    except errors.RunLedgerError as exc:
        _fail(f"error: {type(exc).__name__}: {_one_line(exc)}", EXIT_FAILED)
