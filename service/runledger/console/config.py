"""What a console process is started with (``runledger console`` builds it)."""

from __future__ import annotations

from dataclasses import dataclass

MIN_TOKEN_CHARS = 16
MAX_NAME_CHARS = 100  # the name an operator signs in with; the actor is console:<name>
TOKEN_ENV = "RUNLEDGER_CONSOLE_TOKEN"


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsoleConfig:
    """``database_url`` is read through (an auditor-role login); ``operator_url`` acts,
    and only with ``allow_actions``. ``token``: what an operator signs in with (required
    with ``allow_actions``; when set, every page and ``/api`` need a session or the
    token as a bearer). ``actor``: record every action under this name instead of
    ``console:<the name signed in with>``. ``redact``: tool arguments, results, receipts,
    decision records and run input, state and result are shown as ``[redacted]``."""

    database_url: str
    operator_url: str | None = None
    allow_actions: bool = False
    token: str | None = None
    actor: str | None = None
    redact: bool = False
    connect_timeout: float = 5.0
    silent_after: float = 30.0
    page_size: int = 50
    session_hours: float = 12.0
    read_pool: int = 4

    def __post_init__(self) -> None:
        if self.allow_actions and not self.token:
            raise ValueError(f"actions need a login token ({TOKEN_ENV})")
        if self.allow_actions and not self.operator_url:
            raise ValueError("actions need an operator URL")
        if self.token is not None and len(self.token) < MIN_TOKEN_CHARS:
            raise ValueError(f"the login token must be at least {MIN_TOKEN_CHARS} characters")
        if self.actor is not None and not self.actor.strip():
            raise ValueError("the actor must not be empty")

    @property
    def login_required(self) -> bool:
        return self.token is not None
