"""runledger.config: RUNLEDGER_* first, then DATABASE_URL; URLs normalized for psycopg."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
from pydantic import ValidationError

from runledger.config import (
    Bounds,
    Settings,
    bounds,
    env_names,
    load_settings,
    normalize_url,
    resolve_database_url,
)
from runledger.errors import ConfigurationError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("RUNLEDGER_") or name == "DATABASE_URL":
            monkeypatch.delenv(name)


def test_runledger_database_url_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", "postgresql://rl@h1/a")
    monkeypatch.setenv("DATABASE_URL", "postgresql://other@h2/b")
    settings = Settings()
    assert settings.database_url == "postgresql://rl@h1/a"
    assert settings.require_database_url() == "postgresql://rl@h1/a"


def test_database_url_is_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgres://app@h2/b")
    assert Settings().require_database_url() == "postgresql://app@h2/b"


def test_no_url_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="RUNLEDGER_DATABASE_URL"):
        Settings().require_database_url()


def test_empty_runledger_url_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", "")
    monkeypatch.setenv("DATABASE_URL", "postgresql://app@h2/b")
    assert Settings().require_database_url() == "postgresql://app@h2/b"


def test_explicit_value_beats_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", "postgresql://env@h/a")
    assert load_settings(database_url="postgresql://flag@h/a").database_url == (
        "postgresql://flag@h/a"
    )
    # None means "not given" (an unset CLI option), not "no URL".
    assert load_settings(database_url=None).database_url == "postgresql://env@h/a"


def test_settings_read_other_runledger_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNLEDGER_CONCURRENCY", "8")
    monkeypatch.setenv("RUNLEDGER_LEASE_SECONDS", "12.5")
    monkeypatch.setenv("RUNLEDGER_LOG_JSON", "true")
    settings = Settings()
    assert (settings.concurrency, settings.lease_seconds, settings.log_json) == (8, 12.5, True)


def test_defaults() -> None:
    settings = Settings()
    assert settings.database_url is None
    assert settings.concurrency == 4
    assert settings.lease_seconds == 30.0
    assert settings.max_turns == 50


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("RUNLEDGER_CONCURRENCY", "0"),
        ("RUNLEDGER_CONCURRENCY", "many"),
        ("RUNLEDGER_LEASE_SECONDS", "0.1"),
        ("RUNLEDGER_MAX_TURNS", "0"),
    ],
)
def test_invalid_values_are_refused(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError):
        Settings()


def test_settings_are_frozen() -> None:
    settings = Settings()
    with pytest.raises(ValidationError):
        settings.concurrency = 2


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://u:p@h:5432/db", "postgresql://u:p@h:5432/db"),
        ("postgres://u@h/db", "postgresql://u@h/db"),
        ("postgresql+psycopg://u@h/db?sslmode=require", "postgresql://u@h/db?sslmode=require"),
        ("postgresql+psycopg2://u@h/db", "postgresql://u@h/db"),
        ("host=/tmp dbname=db user=u", "host=/tmp dbname=db user=u"),
        ("", ""),
    ],
)
def test_normalize_url(url: str, expected: str) -> None:
    assert normalize_url(url) == expected


def test_normalize_url_is_idempotent() -> None:
    once = normalize_url("postgresql+psycopg://u@h/db")
    assert normalize_url(once) == once


def test_the_worker_its_cli_and_limits_share_one_set_of_defaults() -> None:
    import inspect

    from runledger.cli.worker import worker
    from runledger.worker import Limits, Worker

    cli = {p.name: p.default for p in worker.params}
    sig = inspect.signature(Worker.__init__).parameters
    limits = Limits()
    for name in ("concurrency", "lease_seconds", "poll_seconds", "grace_seconds"):
        assert cli[name] == sig[name].default == Settings.model_fields[name].default, name
    for name in ("max_turns", "max_calls", "max_stalled_claims", "tool_timeout", "policy_timeout"):
        assert cli[name] == getattr(limits, name) == Settings.model_fields[name].default, name


# -- one declaration per setting: env names, ranges, NaN, precedence ----------------------

FLOAT_SETTINGS = [n for n, f in Settings.model_fields.items() if f.annotation is float]
INT_SETTINGS = [n for n, f in Settings.model_fields.items() if f.annotation is int]

# A valid value other than the default for every setting, as an env var would spell it.
NON_DEFAULT = {
    "database_url": "postgresql://u@h/db",
    "connect_timeout": "2.5",
    "pooler": "transaction",
    "direct_url": "postgresql://u@h:5432/db",
    "worker_id": "w-env",
    "concurrency": "9",
    "lease_seconds": "12.5",
    "poll_seconds": "0.5",
    "grace_seconds": "7",
    "max_turns": "11",
    "max_calls": "13",
    "max_stalled_claims": "3",
    "tool_timeout": "4.5",
    "policy_timeout": "6.5",
    "session_locks": "false",
    "http_port": "9464",
    "http_host": "127.0.0.1",
    "otel": "true",
    "otel_file": "/tmp/spans.jsonl",
    "event_loop": "asyncio",
    "log_json": "true",
    "log_level": "DEBUG",
}


def test_every_setting_has_help_text_and_a_non_default_example() -> None:
    assert set(NON_DEFAULT) == set(Settings.model_fields)
    for name, field in Settings.model_fields.items():
        assert field.description, name


@pytest.mark.parametrize("name", sorted(Settings.model_fields))
def test_every_setting_reads_runledger_name(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    assert env_names(name)[0] == "RUNLEDGER_" + name.upper()
    monkeypatch.setenv("RUNLEDGER_" + name.upper(), NON_DEFAULT[name])
    value = getattr(Settings(), name)
    assert value != Settings.model_fields[name].default
    assert str(value).lower() == NON_DEFAULT[name].lower() or value == float(NON_DEFAULT[name])


def test_only_the_url_has_a_second_env_name() -> None:
    assert env_names("database_url") == ("RUNLEDGER_DATABASE_URL", "DATABASE_URL")
    assert [n for n in Settings.model_fields if len(env_names(n)) > 1] == ["database_url"]


def test_an_empty_variable_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNLEDGER_CONCURRENCY", "")
    monkeypatch.setenv("RUNLEDGER_WORKER_ID", "")
    settings = Settings()
    assert (settings.concurrency, settings.worker_id) == (4, None)


def test_an_override_beats_the_environment_for_every_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RUNLEDGER_CONCURRENCY", "9")
    monkeypatch.setenv("RUNLEDGER_LEASE_SECONDS", "12")
    settings = load_settings(concurrency=2, lease_seconds=None)
    assert (settings.concurrency, settings.lease_seconds) == (2, 12.0)


def test_a_misspelt_setting_is_refused() -> None:
    with pytest.raises(ValidationError, match="lease_second"):
        load_settings(lease_second=5)


@pytest.mark.parametrize("name", FLOAT_SETTINGS)
@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "infinity", "1e999"])
def test_floats_refuse_nan_and_infinities(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv("RUNLEDGER_" + name.upper(), value)
    with pytest.raises(ValidationError, match="finite number"):
        Settings()
    monkeypatch.delenv("RUNLEDGER_" + name.upper())
    with pytest.raises(ValidationError):
        load_settings(**{name: float(value)})


@pytest.mark.parametrize(
    ("name", "refused", "accepted"),
    [
        ("concurrency", [0, 1001], [1, 1000]),
        ("lease_seconds", [0.99, 0.5, 86_400.5], [1, 86_400]),
        ("poll_seconds", [0, 0.049, 3600.1], [0.05, 3600]),
        ("grace_seconds", [-0.1, 3600.1], [0, 3600]),
        ("max_turns", [0, -1], [1, 10**6]),
        ("max_calls", [0], [1]),
        ("max_stalled_claims", [0], [1]),
        ("tool_timeout", [0, 0.009], [0.01, 10**6]),
        ("policy_timeout", [0, -1], [0.01]),
        ("connect_timeout", [0, 0.99, 600.5, -1], [1, 2.5, 600]),
    ],
)
def test_ranges(name: str, refused: list[float], accepted: list[float]) -> None:
    for value in refused:
        with pytest.raises(ValidationError):
            load_settings(**{name: value})
    for value in accepted:
        assert getattr(load_settings(**{name: value}), name) == value


def test_worker_id_is_what_the_database_accepts() -> None:
    assert load_settings(worker_id="w" * 200).worker_id == "w" * 200
    for bad in ("", "w" * 201):
        with pytest.raises(ValidationError):
            load_settings(worker_id=bad)


def test_log_level_is_one_of_the_logging_levels_in_any_case(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RUNLEDGER_LOG_LEVEL", "warning")
    assert Settings().log_level == "WARNING"
    monkeypatch.setenv("RUNLEDGER_LOG_LEVEL", "loud")
    with pytest.raises(ValidationError):
        Settings()


def test_bounds_read_the_declared_range() -> None:
    assert bounds("lease_seconds") == Bounds(min=1, max=86_400)
    assert bounds("max_turns") == Bounds(min=1)
    b = bounds("poll_seconds")
    assert 0.05 in b and 3600 in b
    assert 0.04 not in b and 3600.5 not in b and math.nan not in b and math.inf not in b


def test_a_client_url_is_not_refused_for_a_bad_worker_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RUNLEDGER_CONCURRENCY", "0")
    monkeypatch.setenv("DATABASE_URL", "postgres://app@h/db")
    assert resolve_database_url() == "postgresql://app@h/db"
    assert resolve_database_url("postgresql://flag@h/db") == "postgresql://flag@h/db"
    with pytest.raises(ValidationError):
        Settings()  # the worker is refused


def test_resolve_database_url_without_any_url() -> None:
    with pytest.raises(ConfigurationError, match="--database-url"):
        resolve_database_url(None)


# -- the worker is made from Settings ------------------------------------------------------


def _flow() -> Any:
    from runledger.flows import Flow, ToolCall

    flow = Flow("settings-flow", "1")

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        return []

    return flow


def test_worker_from_settings_takes_every_worker_setting() -> None:
    from runledger.worker import worker_from_settings

    # the process-wide ones: logging, and the event loop run_worker starts
    process = ("log_json", "log_level", "event_loop")
    values = {n: v for n, v in NON_DEFAULT.items() if n not in process}
    settings = Settings(**values)  # type: ignore[arg-type]
    flow = _flow()
    w = worker_from_settings(settings, [flow])
    assert w.database_url == "postgresql://u@h/db"
    assert list(w.flows.values()) == [flow]
    assert (w.worker_id, w.concurrency, w.lease_seconds, w.poll_seconds, w.grace_seconds) == (
        "w-env",
        9,
        12.5,
        0.5,
        7.0,
    )
    limits = w.limits
    assert (
        limits.max_turns,
        limits.max_calls,
        limits.max_stalled_claims,
        limits.tool_timeout,
        limits.policy_timeout,
    ) == (11, 13, 3, 4.5, 6.5)


def test_limits_from_settings_keeps_the_limits_settings_do_not_hold() -> None:
    from runledger.worker import Limits, limits_from_settings

    limits = limits_from_settings(Settings(max_calls=7))
    assert limits.max_calls == 7
    assert (limits.policy_attempts, limits.backoff, limits.max_backoff) == (
        Limits().policy_attempts,
        Limits().backoff,
        Limits().max_backoff,
    )


def test_worker_from_settings_without_a_url_is_a_configuration_error() -> None:
    from runledger.worker import worker_from_settings

    with pytest.raises(ConfigurationError):
        worker_from_settings(Settings(), [_flow()])


# -- the connect timeout: a connection setting, for clients and every command -------------


def test_connect_timeout_is_a_connection_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from runledger.config import ConnectionSettings, connection_settings

    assert "connect_timeout" in ConnectionSettings.model_fields
    assert connection_settings("postgresql://u@h/db").connect_timeout == 5.0
    monkeypatch.setenv("RUNLEDGER_CONNECT_TIMEOUT", "3")
    assert connection_settings("postgresql://u@h/db").connect_timeout == 3.0
    assert connection_settings("postgresql://u@h/db", 7.5).connect_timeout == 7.5  # given wins


@pytest.mark.parametrize("value", ["soon", "nan", "inf", "0", "601"])
def test_a_bad_connect_timeout_is_one_configuration_error_line(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    from runledger.config import connection_settings

    monkeypatch.setenv("RUNLEDGER_CONNECT_TIMEOUT", value)
    with pytest.raises(ConfigurationError, match="RUNLEDGER_CONNECT_TIMEOUT") as info:
        resolve_database_url("postgresql://u@h/db")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigurationError):
        connection_settings("postgresql://u@h/db")


@pytest.mark.parametrize(
    ("seconds", "libpq"), [(1, "2"), (2, "2"), (2.5, "3"), (5, "5"), (600, "600")]
)
def test_with_connect_timeout_gives_libpq_whole_seconds(seconds: float, libpq: str) -> None:
    from psycopg.conninfo import conninfo_to_dict

    from runledger.config import url_connect_timeout, with_connect_timeout

    url = with_connect_timeout("postgresql://u:secret@h:5433/db?sslmode=disable", seconds)
    params = conninfo_to_dict(url)
    assert params["connect_timeout"] == libpq
    assert (params["host"], params["port"], params["dbname"], params["user"]) == (
        "h",
        "5433",
        "db",
        "u",
    )
    assert (params["password"], params["sslmode"]) == ("secret", "disable")
    assert url_connect_timeout(url) == float(libpq)


@pytest.mark.parametrize(
    "url", ["postgresql://u@h/db", "notaurl", "postgresql://h/db?connect_timeout=x"]
)
def test_url_connect_timeout_is_none_unless_the_url_sets_a_usable_one(url: str) -> None:
    from runledger.config import url_connect_timeout

    assert url_connect_timeout(url) is None
    assert url_connect_timeout("postgresql://h/db?connect_timeout=7") == 7.0
