"""What every handler of one console process shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from runledger.console.auth import Session, Sessions
from runledger.console.config import ConsoleConfig
from runledger.console.live import REPLICA_TEXT, Hub
from runledger.console.reads import Reader
from runledger.console.render import Pages


@dataclass
class Console:
    config: ConsoleConfig
    reader: Reader
    hub: Hub
    sessions: Sessions
    pages: Pages
    store: Any = None  # runledger.db.operator_store.OperatorStore, with allow_actions
    extra: dict[str, Any] = field(default_factory=dict)

    def context(self, request: Request, **values: Any) -> dict[str, Any]:
        """What base.html needs, and ``values``; a session's messages are shown once."""
        session = self.sessions.of(request)
        flash: list[tuple[str, str]] = []
        if session is not None and request.query_params.get("fragment") != "1":
            flash, session.flash = session.flash, []
        base: dict[str, Any] = {
            "session": session,
            "flash": flash,
            "allow_actions": self.config.allow_actions,
            "login_required": self.config.login_required,
            "redact": self.config.redact,
            "can_act": self.config.allow_actions and session is not None,
            "live_run": None,
            "poll": None,
            # the header's live-update state until the page's stream says otherwise
            "live_state": REPLICA_TEXT if self.hub.replica.is_set() else "connecting",
            "nav": None,
        }
        base.update(values)
        return base


def console_of(request: Request) -> Console:
    found: Console = request.app.state.console
    return found


def session_of(request: Request) -> Session | None:
    return console_of(request).sessions.of(request)
