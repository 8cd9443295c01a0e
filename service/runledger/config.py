"""One frozen Settings object: ``RUNLEDGER_*`` environment variables, then ``DATABASE_URL``."""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from runledger.errors import ConfigurationError


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RUNLEDGER_", frozen=True, extra="ignore")

    database_url: str | None = None
    worker_id: str | None = None
    concurrency: int = Field(default=4, ge=1, le=1000)
    lease_seconds: float = Field(default=30.0, gt=0.5, le=86_400)
    poll_seconds: float = Field(default=2.0, gt=0, le=3600)
    grace_seconds: float = Field(default=30.0, ge=0, le=3600)
    max_turns: int = Field(default=50, ge=1)
    max_calls: int = Field(default=200, ge=1)
    max_stalled_claims: int = Field(default=5, ge=1)
    tool_timeout: float = Field(default=300.0, gt=0)
    policy_timeout: float = Field(default=300.0, gt=0)
    log_json: bool = False
    log_level: str = "INFO"

    def require_database_url(self) -> str:
        url = self.database_url or os.environ.get("DATABASE_URL")
        if not url:
            raise ConfigurationError(
                "no database URL: set RUNLEDGER_DATABASE_URL (or DATABASE_URL), "
                "or pass --database-url"
            )
        return normalize_url(url)


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
    clean = {k: v for k, v in overrides.items() if v is not None}
    return Settings(**clean)  # type: ignore[arg-type]
