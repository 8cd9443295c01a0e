"""The ``runledger`` command (``python -m runledger`` is the same).

Data goes to stdout, logs to stderr. Exit codes: 0 ok, 1 check failed or refused,
2 usage.

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
import math
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, get_args, get_origin

import click
from click.core import ParameterSource
from pydantic import ValidationError

from runledger import errors
from runledger.config import (
    ENV_PREFIX,
    Settings,
    bounds,
    env_names,
    resolve_database_url,
)

F = TypeVar("F", bound=Callable[..., Any])

CONTEXT = {"show_default": True}


def env_var(option: str) -> str:
    """The one rule: ``--run-id`` reads ``RUNLEDGER_RUN_ID``."""
    return ENV_PREFIX + option.removeprefix("--").upper().replace("-", "_")


class EnvOption(click.Option):
    """An option that names its environment variables in ``--help`` and in its errors."""

    def get_error_hint(self, ctx: click.Context | None) -> str:
        names = " / ".join(f"'{o}'" for o in self.opts)
        envvars = [self.envvar] if isinstance(self.envvar, str) else list(self.envvar or ())
        return f"{names} (env var: {', '.join(envvars)})" if envvars else names


def _opt(*decls: str, **kwargs: Any) -> Callable[[F], F]:
    """An option that reads RUNLEDGER_<OPTION> (unless ``envvar`` is given) and says so."""
    long = next(d for d in decls if d.startswith("--"))
    kwargs.setdefault("envvar", env_var(long))
    kwargs.setdefault("show_envvar", True)
    return click.option(*decls, cls=EnvOption, **kwargs)


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange lets NaN through (every comparison with it is false): not this one."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return super().convert(number, param, ctx)


def _setting_type(name: str) -> click.ParamType[Any, Any]:
    annotation = Settings.model_fields[name].annotation
    if get_origin(annotation) is Literal:
        return click.Choice([str(a) for a in get_args(annotation)], case_sensitive=False)
    if annotation in (int, float):
        b = bounds(name)
        if annotation is int:
            return click.IntRange(
                _int(b.min), _int(b.max), min_open=b.min_open, max_open=b.max_open
            )
        return FiniteFloatRange(b.min, b.max, min_open=b.min_open, max_open=b.max_open)
    return click.STRING


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def setting_option(name: str, *, help: str | None = None) -> Callable[[F], F]:
    """The option of a :class:`Settings` field: ``--<name>``, its env vars, type and range."""
    field = Settings.model_fields[name]
    envvars = env_names(name)
    kwargs: dict[str, Any] = {
        "envvar": envvars[0] if len(envvars) == 1 else list(envvars),
        "help": help or field.description,
        "default": field.default,
    }
    if field.annotation is bool:
        kwargs["is_flag"] = True
    else:
        kwargs["type"] = _setting_type(name)
    return _opt("--" + name.replace("_", "-"), name, **kwargs)


WORKER_SETTINGS: tuple[str, ...] = tuple(Settings.model_fields)


def _settings_options(f: F) -> F:
    for name in reversed(WORKER_SETTINGS):
        f = setting_option(name)(f)
    return f


_GIVEN = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


def build_settings(ctx: click.Context, values: Mapping[str, Any]) -> Settings:
    """Settings from the options given on the command line or in their env vars.

    The rest come from the defaults; a refusal is a usage error naming the option.
    """
    given = {n: v for n, v in values.items() if ctx.get_parameter_source(n) in _GIVEN}
    try:
        return Settings(**given)
    except ValidationError as exc:
        raise _usage_error(ctx, exc) from None


def _usage_error(ctx: click.Context, exc: ValidationError) -> click.UsageError:
    first = exc.errors()[0]
    name = str(first["loc"][0]) if first["loc"] else ""
    for param in ctx.command.params:
        if param.name == name:
            return click.BadParameter(f"{first['msg']}.", ctx=ctx, param=param)
    return click.UsageError(f"{name}: {first['msg']}", ctx=ctx)


def _database_url(value: str | None) -> str:
    try:
        return resolve_database_url(value)
    except errors.ConfigurationError as exc:
        raise click.UsageError(str(exc)) from exc


def emit(data: Any, *, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(data, default=str, indent=2, sort_keys=True))
    else:
        click.echo(data)


database_option = setting_option("database_url")
json_option = _opt("--json", "as_json", is_flag=True, help="Machine-readable output.")


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="runledger-pg")
def main() -> None:
    """runledger: durable, fenced AI-agent runs on PostgreSQL."""


@main.command(context_settings=CONTEXT)
@database_option
@_opt("--sql", "sql_only", is_flag=True, help="Print the SQL; do not connect.")
@_opt("--check", is_flag=True, help="Exit 1 when the database is behind; change nothing.")
@_opt("--revision", default="head", help="Target revision.")
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
    from runledger.worker import configure_logging, load_flows, run_worker, worker_from_settings

    settings = build_settings(ctx, values)
    configure_logging(settings.log_level, settings.log_json)
    _database_url(settings.database_url)  # no URL: a usage error before importing flows
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        w = worker_from_settings(settings, load_flows(flow_specs))
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
@_opt("--priority", type=click.IntRange(-(2**31), 2**31 - 1), default=0, help="Higher runs first.")
@json_option
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
@json_option
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
@_opt("--timeout", type=FiniteFloatRange(min=0), default=60.0, help="Seconds to wait.")
@json_option
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
@_opt("--receipt", default=None, help="Provider receipt (JSON object) for 'applied'.")
@_opt("--note", default=None, help="Why; kept in the ledger.")
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
@_opt("--reason", default=None, help="Why; kept in the ledger.")
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
@json_option
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
@setting_option("database_url", help="PostgreSQL URL; default: a throwaway cluster.")
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
