"""runledger.config: RUNLEDGER_* first, then DATABASE_URL; URLs normalized for psycopg."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from runledger.config import Settings, load_settings, normalize_url
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

    from runledger.cli import worker
    from runledger.worker import Limits, Worker

    cli = {p.name: p.default for p in worker.params}
    sig = inspect.signature(Worker.__init__).parameters
    limits = Limits()
    for name in ("concurrency", "lease_seconds", "poll_seconds", "grace_seconds"):
        assert cli[name] == sig[name].default == Settings.model_fields[name].default, name
    for name in ("max_turns", "max_calls", "max_stalled_claims", "tool_timeout", "policy_timeout"):
        assert cli[name] == getattr(limits, name) == Settings.model_fields[name].default, name
