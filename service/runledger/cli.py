"""The ``runledger`` command (``python -m runledger`` is the same).

Data goes to stdout, logs to stderr. Exit codes: 0 ok, 1 check failed or refused,
2 usage. Every option also reads ``RUNLEDGER_<OPTION>`` (``--help`` shows it).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from runledger import errors
from runledger.config import default, load_settings

F = TypeVar("F", bound=Callable[..., Any])

CONTEXT = {"auto_envvar_prefix": "RUNLEDGER", "show_default": True}


def _database_url(value: str | None) -> str:
    try:
        return load_settings(database_url=value).require_database_url()
    except errors.ConfigurationError as exc:
        raise click.UsageError(str(exc)) from exc


def emit(data: Any, *, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(data, default=str, indent=2, sort_keys=True))
    else:
        click.echo(data)


database_option = click.option(
    "--database-url",
    envvar=["RUNLEDGER_DATABASE_URL", "DATABASE_URL"],
    show_envvar=True,
    help="PostgreSQL URL (RUNLEDGER_DATABASE_URL, then DATABASE_URL).",
)


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="runledger-pg")
def main() -> None:
    """runledger: durable, fenced AI-agent runs on PostgreSQL."""


@main.command(context_settings=CONTEXT)
@database_option
@click.option("--sql", "sql_only", is_flag=True, help="Print the SQL; do not connect.")
@click.option("--check", is_flag=True, help="Exit 1 when the database is behind; change nothing.")
@click.option("--revision", default="head", help="Target revision.")
def migrate(database_url: str | None, sql_only: bool, check: bool, revision: str) -> None:
    """Upgrade the runledger schema (safe to run from several processes at once)."""
    from runledger.db import migrate as m

    if sql_only:
        click.echo(m.offline_sql(revision), nl=False)
        return
    url = _database_url(database_url)
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


def _opt(*decls: str, **kwargs: Any) -> Callable[[F], F]:
    """An option that also reads RUNLEDGER_<NAME> and says so in --help."""
    kwargs.setdefault("show_envvar", True)
    return click.option(*decls, **kwargs)


@main.command(context_settings=CONTEXT)
@database_option
@_opt(
    "--flows",
    "flow_specs",
    multiple=True,
    required=True,
    envvar="RUNLEDGER_FLOWS",
    help="package.module:attribute holding a Flow or a list of Flows (repeatable).",
)
@_opt(
    "--concurrency", type=click.IntRange(1, 1000), default=default("concurrency"), help="Run slots."
)
@_opt(
    "--lease-seconds",
    type=click.FloatRange(1, 86400),
    default=default("lease_seconds"),
    help="Lease length.",
)
@_opt("--worker-id", default=None, help="Stable id for this worker (default host:pid:random).")
@_opt(
    "--poll-seconds",
    type=click.FloatRange(0.05, 3600),
    default=default("poll_seconds"),
    help="Claim poll interval when no notification arrives.",
)
@_opt(
    "--grace-seconds",
    type=click.FloatRange(0, 3600),
    default=default("grace_seconds"),
    help="On SIGTERM, time for in-flight calls to finish.",
)
@_opt(
    "--max-turns",
    type=click.IntRange(1),
    default=default("max_turns"),
    help="Per-run budget of turns.",
)
@_opt(
    "--max-calls",
    type=click.IntRange(1),
    default=default("max_calls"),
    help="Per-run budget of tool calls.",
)
@_opt(
    "--max-stalled-claims",
    type=click.IntRange(1),
    default=default("max_stalled_claims"),
    help="Claims without progress before a run fails as crash_loop.",
)
@_opt(
    "--tool-timeout",
    type=click.FloatRange(0.01),
    default=default("tool_timeout"),
    help="Default tool timeout in seconds (a timeout is ambiguous).",
)
@_opt(
    "--policy-timeout",
    type=click.FloatRange(0.01),
    default=default("policy_timeout"),
    help="Policy timeout.",
)
@_opt("--log-json", is_flag=True, help="JSON log lines on stderr.")
@_opt("--log-level", default=default("log_level"), help="Log level.")
def worker(
    database_url: str | None,
    flow_specs: tuple[str, ...],
    concurrency: int,
    lease_seconds: float,
    worker_id: str | None,
    poll_seconds: float,
    grace_seconds: float,
    max_turns: int,
    max_calls: int,
    max_stalled_claims: int,
    tool_timeout: float,
    policy_timeout: float,
    log_json: bool,
    log_level: str,
) -> None:
    """Run a worker process: claim runs of the given flows and drive them."""
    import os

    from runledger.worker import Limits, Worker, configure_logging, load_flows, run_worker

    configure_logging(log_level, log_json)
    url = _database_url(database_url)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        flows = load_flows(flow_specs)
        w = Worker(
            database_url=url,
            flows=flows,
            worker_id=worker_id,
            concurrency=concurrency,
            lease_seconds=lease_seconds,
            poll_seconds=poll_seconds,
            grace_seconds=grace_seconds,
            limits=Limits(
                max_turns=max_turns,
                max_calls=max_calls,
                max_stalled_claims=max_stalled_claims,
                tool_timeout=tool_timeout,
                policy_timeout=policy_timeout,
            ),
        )
    except (ValueError, ImportError) as exc:
        raise click.UsageError(str(exc)) from exc
    run_worker(w)


def _client(database_url: str | None) -> Any:
    from runledger.client import Client

    return Client(_database_url(database_url), actor=f"cli:{os.environ.get('USER', 'operator')}")


@main.command(context_settings=CONTEXT)
@database_option
@click.argument("flow")
@_opt("--input", "input_json", default="{}", help="The run's input: a JSON object.")
@_opt("--run-id", default=None, help="Run id (default: generated). Resubmitting is a no-op.")
@_opt("--priority", type=int, default=0, help="Higher runs first.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def submit(
    database_url: str | None,
    flow: str,
    input_json: str,
    run_id: str | None,
    priority: int,
    as_json: bool,
) -> None:
    """Submit a run of FLOW (name@version)."""
    try:
        payload = json.loads(input_json)
    except ValueError as exc:
        raise click.UsageError(f"--input is not JSON: {exc}") from exc
    with _client(database_url) as client:
        name, version = client.resolve_flow(flow)
        ref = f"{name}@{version}"
        if ref not in client.known_flows():
            click.echo(
                f"warning: no worker has registered {ref} yet; the run waits for one", err=True
            )
        res = client.submit(ref, payload, run_id=run_id, priority=priority)
    if as_json:
        emit({"run_id": res.run_id, "created": res.created}, as_json=True)
    else:
        click.echo(f"{res.run_id} {'submitted' if res.created else 'already exists (no-op)'}")


def _run_dict(run: Any) -> dict[str, Any]:
    import dataclasses

    return {k: (str(v) if k == "status" else v) for k, v in dataclasses.asdict(run).items()}


@main.command(context_settings=CONTEXT)
@database_option
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(database_url: str | None, run_id: str, as_json: bool) -> None:
    """Show a run and its calls."""
    with _client(database_url) as client:
        run = client.get(run_id)
        calls = client.calls(run_id)
    if as_json:
        import dataclasses

        emit(
            {
                "run": _run_dict(run),
                "calls": [{**dataclasses.asdict(c), "status": str(c.status)} for c in calls],
            },
            as_json=True,
        )
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]{run.run_id}[/] {run.flow}@{run.flow_version} [bold]{run.status}[/] "
        f"token={run.fencing_token} state_version={run.state_version}"
        + (f" pause_reason={run.pause_reason!r}" if run.pause_reason else "")
    )
    table = Table("key", "tool", "status", "attempts", "result", "receipt")
    for c in calls:
        table.add_row(
            c.idempotency_key,
            c.tool,
            str(c.status),
            str(c.attempts),
            json.dumps(c.result),
            json.dumps(c.receipt),
        )
    console.print(table)


@main.command(context_settings=CONTEXT)
@database_option
@click.argument("run_id")
@_opt("--timeout", type=float, default=60.0, help="Seconds to wait.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def wait(database_url: str | None, run_id: str, timeout: float, as_json: bool) -> None:
    """Wait until a run succeeds, fails, is cancelled or pauses; exit 1 unless it succeeded."""
    with _client(database_url) as client:
        try:
            run = client.wait(run_id, timeout)
        except TimeoutError as exc:
            click.echo(str(exc), err=True)
            sys.exit(1)
    emit(_run_dict(run) if as_json else f"{run.run_id} {run.status}", as_json=as_json)
    sys.exit(0 if run.status == "succeeded" else 1)


@main.command(context_settings=CONTEXT)
@database_option
@click.argument("key")
@click.argument("resolution", type=click.Choice(["applied", "not_applied", "abandoned"]))
@click.option("--receipt", default=None, help="Provider receipt (JSON object) for 'applied'.")
@click.option("--note", default=None, help="Why; kept in the ledger.")
def resolve(
    database_url: str | None, key: str, resolution: str, receipt: str | None, note: str | None
) -> None:
    """Resolve an unknown call of a paused run."""
    try:
        receipt_obj = json.loads(receipt) if receipt else None
    except ValueError as exc:
        raise click.UsageError(f"--receipt is not JSON: {exc}") from exc
    with _client(database_url) as client:
        client.resolve(key, resolution, receipt_obj, note)
    click.echo(f"{key} resolved as {resolution}")


@main.command(context_settings=CONTEXT)
@database_option
@click.argument("run_id")
@click.option("--reason", default=None, help="Why; kept in the ledger.")
def cancel(database_url: str | None, run_id: str, reason: str | None) -> None:
    """Cancel a run; its current lease holder is refused from then on."""
    with _client(database_url) as client:
        client.cancel(run_id, reason)
    click.echo(f"{run_id} cancelled")


@main.command(context_settings=CONTEXT)
@database_option
@click.argument("run_id")
def retry(database_url: str | None, run_id: str) -> None:
    """Put a failed or paused run back in the queue."""
    with _client(database_url) as client:
        client.retry(run_id)
    click.echo(f"{run_id} queued")


@main.command(context_settings=CONTEXT)
@database_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def audit(database_url: str | None, as_json: bool) -> None:
    """Check the run tables' invariants; exit 1 when any is broken."""
    from runledger.audit import run_checks

    findings = run_checks(_database_url(database_url))
    if as_json:
        emit(
            [{"check": f.check.name, "ok": f.ok, "violations": f.rows} for f in findings],
            as_json=True,
        )
    else:
        for f in findings:
            mark = "ok  " if f.ok else "FAIL"
            click.echo(f"{mark} {f.check.name}: {f.check.description}")
            for row in f.rows:
                click.echo(f"     {json.dumps(row, default=str)}")
    sys.exit(0 if all(f.ok for f in findings) else 1)


@main.command(context_settings=CONTEXT)
@click.option(
    "--database-url",
    envvar=["RUNLEDGER_DATABASE_URL", "DATABASE_URL"],
    show_envvar=True,
    help="PostgreSQL URL; default: a throwaway cluster.",
)
@_opt("--runs", type=click.IntRange(1, 10000), default=40, help="Runs to submit.")
@_opt("--workers", "n_workers", type=click.IntRange(1, 32), default=3, help="Worker processes.")
@_opt("--kills", type=click.IntRange(0, 100), default=3, help="SIGKILLs during the run.")
@_opt("--seed", type=int, default=7, help="Which workers get killed.")
def demo(database_url: str | None, runs: int, n_workers: int, kills: int, seed: int) -> None:
    """Run the demo: workers SIGKILLed mid-call, then an audit of the effects."""
    from runledger.demo.run import run_demo

    sys.exit(run_demo(database_url, runs, n_workers, kills, seed))


def run() -> None:
    """Entry point that turns runledger errors into exit code 1 with a clear line."""
    try:
        main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(1)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except errors.RunLedgerError as exc:
        click.echo(f"error: {type(exc).__name__}: {exc}", err=True)
        sys.exit(1)
