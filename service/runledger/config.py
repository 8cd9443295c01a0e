"""One frozen Settings object: ``RUNLEDGER_*`` environment variables, then ``DATABASE_URL``.

Every worker and connection setting is declared here once: its name, type, default, range
and help text. The rest follows from the declaration:

- its environment variable is ``RUNLEDGER_<NAME>`` (``database_url`` also falls back to
  ``DATABASE_URL``; :func:`env_names` says which);
- ``runledger worker`` generates its option ``--<name-with-dashes>`` from the field, with
  the field's range (``runledger.cli``), builds a :class:`Settings` from the options it was
  given (a flag beats the environment, which beats the default) and makes the worker with
  :func:`runledger.worker.worker_from_settings`;
- floats are finite: NaN and infinities are refused, whatever the range.

:class:`ConnectionSettings` (the URL and ``connect_timeout``) is what a client reads
(:func:`connection_settings`); every CLI command that connects has ``--connect-timeout``
from the same field, and the worker passes it on in its URL (:func:`with_connect_timeout`).

An empty environment variable counts as unset (as it does for click).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import annotated_types
import psycopg
from pydantic import AliasChoices, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from runledger.errors import ConfigurationError

ENV_PREFIX = "RUNLEDGER_"

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
# what the database URL reaches (docs/operating.md, "PgBouncer"): auto (found out when
# connecting), or a pooler in session or transaction mode
Pooler = Literal["auto", "session", "transaction"]
EventLoop = Literal["auto", "asyncio", "uvloop"]

_CONFIG = SettingsConfigDict(
    env_prefix=ENV_PREFIX,
    env_ignore_empty=True,
    frozen=True,
    extra="forbid",  # a misspelt keyword is an error, not a silently ignored setting
    allow_inf_nan=False,
    populate_by_name=True,
)


class ConnectionSettings(BaseSettings):
    """What a client needs: where the database is. :class:`Settings` adds the worker's."""

    model_config = _CONFIG

    database_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("RUNLEDGER_DATABASE_URL", "DATABASE_URL"),
        description="PostgreSQL URL.",
    )
    connect_timeout: float = Field(
        default=5.0,
        ge=1,
        le=600,
        description="Seconds to wait for the database before failing with one line.",
    )
    pooler: Pooler = Field(
        default="auto",
        description="What the database URL reaches: a pooler in transaction mode (PgBouncer's "
        "pool_mode = transaction: nothing is prepared on its sessions, no LISTEN, no session "
        "lock), in session mode, or auto: PostgreSQL or a pooler, found out when connecting "
        "(docs/operating.md, PgBouncer).",
    )

    @field_validator("pooler", mode="before")
    @classmethod
    def _lower_pooler(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    def require_database_url(self) -> str:
        if not self.database_url:
            raise ConfigurationError(
                "no database URL: set RUNLEDGER_DATABASE_URL (or DATABASE_URL), "
                "or pass --database-url"
            )
        return normalize_url(self.database_url)


class Settings(ConnectionSettings):
    """Every setting of a worker process (the connection's included)."""

    model_config = _CONFIG

    worker_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="Stable id for this worker (default host:pid:random).",
    )
    concurrency: int = Field(default=4, ge=1, le=1000, description="Run slots.")
    lease_seconds: float = Field(
        default=30.0, ge=1, le=86_400, description="Lease length; renewed every third of it."
    )
    poll_seconds: float = Field(
        default=2.0,
        ge=0.05,
        le=3600,
        description="Claim poll interval when no notification arrives.",
    )
    grace_seconds: float = Field(
        default=30.0, ge=0, le=3600, description="On SIGTERM, time for in-flight calls to finish."
    )
    max_turns: int = Field(default=50, ge=1, description="Per-run budget of turns.")
    max_calls: int = Field(default=200, ge=1, description="Per-run budget of tool calls.")
    max_stalled_claims: int = Field(
        default=5, ge=1, description="Claims without progress before a run fails as crash_loop."
    )
    tool_timeout: float = Field(
        default=300.0,
        ge=0.01,
        description="Default tool timeout in seconds (a timeout is ambiguous).",
    )
    policy_timeout: float = Field(default=300.0, ge=0.01, description="Policy timeout in seconds.")
    direct_url: str | None = Field(
        default=None,
        description="A URL that reaches PostgreSQL itself, past the pooler of the database "
        "URL: the worker's listener connects there (LISTEN, its session lock, its "
        "registration), so a dead worker's runs are taken over at once. Without it, behind "
        "a pooler: on lease expiry only.",
    )
    session_locks: bool = Field(
        default=True,
        description="Hold a session lock on the listener connection, so that the runs of "
        "a worker that died are taken over at once, not when their leases expire (off "
        "behind a pooler that does not keep sessions; see docs/leases.md).",
    )
    http_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Serve /livez, /readyz and /metrics on this port (off unless given; "
        "0: any free port, logged). Needs the metrics extra (prometheus-client).",
    )
    http_host: str = Field(
        default="0.0.0.0",
        min_length=1,
        description="Address the --http-port server listens on.",
    )
    otel: bool = Field(
        default=False,
        description="Export OpenTelemetry spans (a span per run, turn and call): an SDK "
        "TracerProvider with the exporters of OTEL_TRACES_EXPORTER (default otlp), "
        "service name OTEL_SERVICE_NAME. Needs the otel extra.",
    )
    otel_file: str | None = Field(
        default=None,
        min_length=1,
        description="Also append every span to this file as a JSON line when it ends "
        "(implies --otel; alone when OTEL_TRACES_EXPORTER is not set).",
    )
    event_loop: EventLoop = Field(
        default="auto",
        description="The worker's event loop: uvloop (a dependency on Linux and macOS; "
        "7-19 % less worker CPU per tool call, measured) or asyncio's own; auto takes uvloop "
        "when it is installed.",
    )
    log_json: bool = Field(default=False, description="JSON log lines on stderr.")
    log_level: LogLevel = Field(default="INFO", description="Log level.")

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_log_level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value


def env_names(name: str) -> tuple[str, ...]:
    """The environment variables a setting reads, first one first."""
    alias = Settings.model_fields[name].validation_alias
    if isinstance(alias, AliasChoices):
        return tuple(c for c in alias.choices if isinstance(c, str))
    return (ENV_PREFIX + name.upper(),)


@dataclass(frozen=True, slots=True, kw_only=True)
class Bounds:
    """A numeric setting's range, as declared on its field (None: unbounded)."""

    min: float | None = None
    max: float | None = None
    min_open: bool = False
    max_open: bool = False

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.min is not None and (value <= self.min if self.min_open else value < self.min):
            return False
        return not (
            self.max is not None and (value >= self.max if self.max_open else value > self.max)
        )


def bounds(name: str) -> Bounds:
    """The range of a numeric setting, read from its field's constraints."""
    found: dict[str, Any] = {}
    for item in Settings.model_fields[name].metadata:
        if isinstance(item, annotated_types.Ge):
            found["min"] = item.ge
        elif isinstance(item, annotated_types.Gt):
            found.update(min=item.gt, min_open=True)
        elif isinstance(item, annotated_types.Le):
            found["max"] = item.le
        elif isinstance(item, annotated_types.Lt):
            found.update(max=item.lt, max_open=True)
    return Bounds(**found)


def normalize_url(url: str) -> str:
    """A libpq URL for psycopg (SQLAlchemy-style ``postgresql+psycopg://`` accepted too)."""
    for prefix in ("postgresql+psycopg://", "postgresql+psycopg2://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql://" + url[len(prefix) :]
    return url


def default(name: str) -> Any:
    """The default of a setting: the one place the worker, its CLI and Limits take it from."""
    return Settings.model_fields[name].default


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, with ``overrides`` on top (None means "not given")."""
    clean = {k: v for k, v in overrides.items() if v is not None}
    return Settings(**clean)  # type: ignore[arg-type]


def connection_settings(
    database_url: str | None = None,
    connect_timeout: float | None = None,
    pooler: str | None = None,
) -> ConnectionSettings:
    """The connection settings: the values given, else the environment, else the defaults.

    A bad value (``RUNLEDGER_CONNECT_TIMEOUT=soon``) is a one-line ``ConfigurationError``.
    Reads the connection settings only: a client is not refused for a bad worker setting.
    """
    given: dict[str, Any] = {}
    if database_url:
        given["database_url"] = database_url
    if connect_timeout is not None:
        given["connect_timeout"] = connect_timeout
    if pooler is not None:
        given["pooler"] = pooler
    try:
        return ConnectionSettings(**given)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else "setting"
        raise ConfigurationError(
            f"{name} ({ENV_PREFIX}{name.upper()}): {first['msg']}, got {first.get('input')!r}"
        ) from None


def resolve_database_url(value: str | None = None) -> str:
    """``value`` when given, else ``RUNLEDGER_DATABASE_URL``, else ``DATABASE_URL``."""
    return connection_settings(value).require_database_url()


def with_connect_timeout(url: str, seconds: float) -> str:
    """``url`` with libpq's ``connect_timeout`` set, so that every connection made from it
    (a worker's pool and its listener too) gives up after ``seconds`` (libpq counts whole
    seconds, at least 2, so ``seconds`` is rounded up to that)."""
    from psycopg.conninfo import make_conninfo

    return make_conninfo(url, connect_timeout=str(max(2, math.ceil(seconds))))


def url_connect_timeout(url: str) -> float | None:
    """The ``connect_timeout`` a URL or conninfo string sets, if it sets a usable one."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        value = conninfo_to_dict(url).get("connect_timeout")
        seconds = float(value) if value is not None else None
    except (ValueError, TypeError, psycopg.Error):
        return None
    return seconds if seconds is not None and math.isfinite(seconds) and seconds > 0 else None
