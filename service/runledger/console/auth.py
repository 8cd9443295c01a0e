"""Signing in, sessions and CSRF.

The login token comes from ``RUNLEDGER_CONSOLE_TOKEN`` and is compared in constant time
(:func:`hmac.compare_digest`). A session is a random id in an ``HttpOnly``,
``SameSite=Strict`` cookie (``Secure`` over https), held in this process's memory only
(a restart signs everyone out) and good for ``session_hours``. Each session has its own
CSRF token, which every form carries and every POST must send back; the login form,
before there is a session, uses a double-submit cookie. A POST whose ``Origin`` names
another host is refused as well.

``/api`` also takes the token itself as ``Authorization: Bearer <token>`` (for scripts;
reads only: actions are forms of a signed-in session).
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from starlette.requests import Request

from runledger.console.config import MAX_NAME_CHARS, ConsoleConfig

SESSION_COOKIE = "rl_session"
LOGIN_COOKIE = "rl_login_csrf"
FAILED_LOGIN_DELAY = 0.5  # seconds before a wrong token is answered


@dataclass(slots=True)
class Session:
    sid: str
    name: str
    actor: str
    csrf: str
    expires: float
    flash: list[tuple[str, str]] = field(default_factory=list)  # (kind, message)


class Sessions:
    def __init__(self, config: ConsoleConfig) -> None:
        self.config = config
        self._by_id: dict[str, Session] = {}

    def token_matches(self, given: str) -> bool:
        token = self.config.token
        if token is None:
            return False
        return hmac.compare_digest(given.encode("utf-8"), token.encode("utf-8"))

    def actor_for(self, name: str) -> str:
        return self.config.actor or f"console:{name}"

    def start(self, name: str) -> Session:
        self._expire()
        session = Session(
            sid=secrets.token_urlsafe(32),
            name=name,
            actor=self.actor_for(name),
            csrf=secrets.token_urlsafe(32),
            expires=time.monotonic() + self.config.session_hours * 3600,
        )
        self._by_id[session.sid] = session
        return session

    def of(self, request: Request) -> Session | None:
        sid = request.cookies.get(SESSION_COOKIE)
        if not sid:
            return None
        session = self._by_id.get(sid)
        if session is None:
            return None
        if session.expires <= time.monotonic():
            del self._by_id[sid]
            return None
        return session

    def end(self, session: Session) -> None:
        self._by_id.pop(session.sid, None)

    def _expire(self) -> None:
        now = time.monotonic()
        for sid in [s for s, v in self._by_id.items() if v.expires <= now]:
            del self._by_id[sid]

    def bearer_ok(self, request: Request) -> bool:
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        return scheme.lower() == "bearer" and bool(value) and self.token_matches(value.strip())


def csrf_ok(expected: str, given: object) -> bool:
    return isinstance(given, str) and hmac.compare_digest(
        given.encode("utf-8"), expected.encode("utf-8")
    )


def same_origin(request: Request) -> bool:
    """No ``Origin`` header (an old browser, a script), or one naming this very host."""
    origin = request.headers.get("origin")
    if origin is None:
        return True
    if origin == "null":
        return False
    return urlsplit(origin).netloc == request.headers.get("host", "")


def check_name(name: str) -> str | None:
    """Why ``name`` cannot be signed in with, or None."""
    if not name.strip():
        return "give your name: it is recorded with every action you take"
    if len(name) > MAX_NAME_CHARS:
        return f"the name must be at most {MAX_NAME_CHARS} characters"
    if any(not ch.isprintable() for ch in name):
        return "the name must be printable characters only"
    return None


def safe_next(target: str | None) -> str:
    """A path on this site to go back to after signing in (never another site's)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/runs"
    return target


async def slow_down() -> None:
    await asyncio.sleep(FAILED_LOGIN_DELAY)
