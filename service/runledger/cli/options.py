"""What every ``runledger`` command shares: its options, their one environment rule, and
how a command reaches the database (a client, or a read-only connection).

``--some-option`` reads ``RUNLEDGER_SOME_OPTION`` (set on each option explicitly by
:func:`opt`, never derived by click); the worker's options are generated from
:class:`runledger.config.Settings`, so each setting has exactly one range.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import UnionType
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import click
from click.core import ParameterSource
from pydantic import ValidationError

from runledger import errors
from runledger.cli.exits import one_line
from runledger.config import ENV_PREFIX, Settings, bounds, connection_settings, env_names
from runledger.model import MAX_JSON_DEPTH
from runledger.present import parse_since

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


def opt(*decls: str, **kwargs: Any) -> Callable[[F], F]:
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
    if get_origin(annotation) in (Union, UnionType):  # an optional number: its type's range
        annotation = next(a for a in get_args(annotation) if a is not type(None))
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
    long = "--" + name.replace("_", "-")
    if field.annotation is bool and field.default is True:  # on unless turned off
        envvar = kwargs.pop("envvar")
        return opt(f"{long}/--no-{long[2:]}", name, envvar=envvar, **kwargs)
    if field.annotation is bool:
        kwargs["is_flag"] = True
    else:
        kwargs["type"] = _setting_type(name)
    return opt(long, name, **kwargs)


WORKER_SETTINGS: tuple[str, ...] = tuple(Settings.model_fields)


def settings_options(f: F) -> F:
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


def require_url(value: str | None) -> str:
    """``--database-url``, else its environment variables: a URL, or a usage error (exit 2)."""
    try:
        return connection_settings(value).require_database_url()
    except errors.ConfigurationError as exc:
        raise click.UsageError(str(exc)) from exc


def default_actor() -> str:
    """Who an operator command acts as unless ``--actor`` says: ``cli:$USER``."""
    return f"cli:{os.environ.get('USER', 'operator')}"


def open_client(
    database_url: str | None, connect_timeout: float | None, actor: str | None = None
) -> Any:
    """A :class:`runledger.client.Client` acting as ``actor`` (default: ``cli:$USER``)."""
    from runledger.client import Client

    return Client(
        require_url(database_url),
        actor=actor or default_actor(),
        connect_timeout=connect_timeout,
    )


def json_arg(option: str, text: str, *, obj: bool) -> Any:
    """``text`` parsed and checked like the store will check it, or a usage error (exit 2).

    ``json.loads`` recurses: input nested a hundred thousand levels deep would raise
    ``RecursionError``. Anything deeper than :data:`MAX_JSON_DEPTH` is refused here, parsed
    or not, with the limit named.
    """
    from runledger.db.validate import check_json

    try:
        value = json.loads(text)
    except RecursionError:
        raise click.UsageError(
            f"{option} nests deeper than the limit of {MAX_JSON_DEPTH} levels of objects and arrays"
        ) from None
    except ValueError as exc:
        raise click.UsageError(f"{option} is not JSON: {exc}") from None
    try:
        check_json(option, value, obj=obj)
    except errors.InvalidInput as exc:
        raise click.UsageError(one_line(exc)) from None
    return value


def emit(data: Any, *, as_json: bool) -> None:
    """``data`` on stdout: as sorted, indented JSON with ``as_json``, else as it is."""
    if as_json:
        click.echo(json.dumps(data, default=str, indent=2, sort_keys=True))
    else:
        click.echo(data)


database_option = setting_option("database_url")
connect_option = setting_option("connect_timeout")
json_option = opt("--json", "as_json", is_flag=True, help="Machine-readable output.")


def _not_empty(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value == "":
        raise click.BadParameter("must not be empty (leave it out for cli:$USER).")
    return value


actor_option = opt(
    "--actor",
    default=None,
    callback=_not_empty,
    help="Who decides, kept with the call and in the event (default: cli:$USER).",
)

# -- the read commands: --since, --limit, --lease-seconds, a read-only connection ----------

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

    return opt(
        "--limit",
        type=click.IntRange(1, MAX_LIMIT),
        default=default,
        help=f"At most this many {what}.",
    )


class SinceType(click.ParamType):  # type: ignore[type-arg]
    """``30m``, ``2h``, ``7d``, ``90s`` (before the database's now), or an ISO 8601
    timestamp (without a zone: UTC): :func:`runledger.present.parse_since`."""

    name = "DURATION|TIMESTAMP"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from runledger.db.inspect import Since

        if isinstance(value, Since):
            return value
        try:
            return parse_since(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


since_option = opt(
    "--since",
    type=SinceType(),
    default=None,
    help="Only since then: a duration before the database's now (30m, 2h, 7d) or an "
    "ISO timestamp (UTC unless it says).",
)


@contextmanager
def reading(database_url: str | None, connect_timeout: float) -> Iterator[Any]:
    """A read-only connection, once the database answered as every command needs it to."""
    from runledger.db.connecting import probe_blocking
    from runledger.db.inspect import read_connection

    url = require_url(database_url)
    # unreachable, no schema, an older schema: the one-line errors every command gives
    probe_blocking(url, timeout=connect_timeout, application_name="runledger-cli")
    with read_connection(url, connect_timeout) as conn:
        yield conn
