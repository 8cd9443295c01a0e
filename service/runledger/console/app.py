"""The Starlette app: routes, the read gate, errors as pages or JSON, the lifespan.

Routes (docs/console.md has the JSON shapes)::

    GET  /runs  /runs/{run_id}  /inbox  /workers        pages (?fragment=1: the main part)
    GET  /api  /api/runs  /api/runs/{run_id}  /api/inbox  /api/workers  /api/events
    GET  /api/stream                                    server-sent events
    GET  /login  POST /login  POST /logout
    POST /calls/{key}/resolve|approve|deny  /runs/{run_id}/cancel|retry   actions

With a login token configured, every page and ``/api`` need a session (``/api`` also
takes ``Authorization: Bearer <token>``); ``/login`` and ``/static`` never do.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from runledger import errors
from runledger.console import actions, auth, pages
from runledger.console.config import ConsoleConfig
from runledger.console.live import Hub
from runledger.console.params import BadRequest
from runledger.console.reads import Reader
from runledger.console.render import Pages
from runledger.console.state import Console, console_of

log = logging.getLogger(__name__)

OPEN_PATHS = ("/login", "/static/", "/favicon.ico")


def _is_api(request: Request) -> bool:
    return request.url.path == "/api" or request.url.path.startswith("/api/")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def problem(
    request: Request,
    status: int,
    message: str,
    *,
    param: str | None = None,
    hint: str | None = None,
) -> Response:
    """An error as ``{"error", "status", ...}`` under /api, else as a page."""
    if _is_api(request):
        body: dict[str, Any] = {"error": message, "status": status}
        if param is not None:
            body["param"] = param
        if hint is not None:
            body["hint"] = hint
        return JSONResponse(body, status_code=status, headers={"Cache-Control": "no-store"})
    console = console_of(request)
    titles = {
        400: "Bad request",
        401: "Sign in first",
        403: "Refused",
        404: "Not found",
        409: "Refused by the database",
        503: "Database unavailable",
    }
    run_id = request.path_params.get("run_id") or (
        request.path_params.get("key", "").rsplit(":", 2)[0] or None
    )
    back = "/runs/" + quote(run_id, safe="") if run_id and request.method == "POST" else None
    if status == 401:
        hint = hint or "sign in on /login"
        back = "/login?next=" + quote(back or request.url.path, safe="/")
    return console.pages.render(
        request,
        "error.html",
        console.context(
            request,
            status=status,
            title=titles.get(status, "Error"),
            message=message,
            hint=hint,
            back=back,
        ),
        status=status,
    )


async def _bad_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BadRequest)
    return problem(request, 400, exc.message, param=exc.param)


async def _refused(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, actions.Refused)
    return problem(request, exc.status, exc.message, hint=exc.hint)


async def _runledger_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, errors.RunLedgerError)
    status = 500
    if isinstance(exc, errors.RunNotFound):
        status = 404
    elif isinstance(exc, errors.InvalidInput):
        status = 400
    elif isinstance(exc, errors.InvalidTransition | errors.RunConflict):
        status = 409
    elif isinstance(exc, errors.DatabaseUnavailable | errors.SchemaMissing | errors.ReadOnly):
        status = 503  # ReadOnly: an action sent to a standby, which cannot take it
    if status == 500:
        log.error("console: %s on %s: %s", type(exc).__name__, request.url.path, _one_line(exc))
    return problem(request, status, f"{type(exc).__name__}: {_one_line(exc)}")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return problem(request, exc.status_code, str(exc.detail))


async def _crash(request: Request, exc: Exception) -> Response:
    log.exception("console: unexpected error on %s", request.url.path)
    return problem(request, 500, f"internal error ({type(exc).__name__}); see the console's log")


class ReadGate:
    """With a login token: no page or /api without a session (or, for /api, the token as
    a bearer). Without one (read-only), everything is open to whoever reaches the port."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        console = console_of(request)
        path = request.url.path
        if (
            not console.config.login_required
            or path.startswith(OPEN_PATHS)
            or request.method == "POST"  # actions check their session and CSRF themselves
            or console.sessions.of(request) is not None
            or (_is_api(request) and console.sessions.bearer_ok(request))
        ):
            await self.app(scope, receive, send)
            return
        response: Response
        if _is_api(request):
            response = JSONResponse(
                {
                    "error": "sign in first (a session, or Authorization: Bearer <token>)",
                    "status": 401,
                },
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        else:
            target = path + (f"?{request.url.query}" if request.url.query else "")
            response = RedirectResponse("/login?next=" + quote(target, safe="/"), 303)
        await response(scope, receive, send)


# -- signing in -------------------------------------------------------------------------


def _secure(request: Request) -> bool:
    return request.url.scheme == "https"


async def login_page(
    request: Request, *, error: str | None = None, name: str = "", status: int = 200
) -> Response:
    console = console_of(request)
    if not console.config.login_required:
        return problem(request, 404, "this console has no login: it is read-only and open")
    csrf = secrets.token_urlsafe(24)
    response = console.pages.render(
        request,
        "login.html",
        console.context(
            request,
            error=error,
            name=name,
            login_csrf=csrf,
            next=auth.safe_next(request.query_params.get("next")),
            fixed_actor=console.config.actor,
        ),
        status=status,
    )
    response.set_cookie(
        auth.LOGIN_COOKIE,
        csrf,
        httponly=True,
        samesite="strict",
        secure=_secure(request),
        path="/login",
        max_age=3600,
    )
    return response


async def login(request: Request) -> Response:
    console = console_of(request)
    if not console.config.login_required:
        return problem(request, 404, "this console has no login: it is read-only and open")
    form = await request.form(max_files=0, max_fields=10)
    cookie = request.cookies.get(auth.LOGIN_COOKIE)
    if not auth.same_origin(request) or not cookie or not auth.csrf_ok(cookie, form.get("csrf")):
        return problem(
            request,
            403,
            "refused: the sign-in form's CSRF token is missing or wrong; reload the page",
        )
    name = form.get("name")
    token = form.get("token")
    name = name.strip() if isinstance(name, str) else ""
    if console.config.actor is None:
        why = auth.check_name(name)
        if why is not None:
            return await login_page(request, error=why, name=name, status=400)
    else:
        name = console.config.actor
    if not isinstance(token, str) or not console.sessions.token_matches(token):
        await auth.slow_down()
        log.warning("console: a sign-in with a wrong token (name %r)", name[:100])
        return await login_page(request, error="wrong token", name=name, status=401)
    session = console.sessions.start(name)
    log.info("console: %s signed in (actions as %s)", name, session.actor)
    next_value = form.get("next")
    target = auth.safe_next(next_value if isinstance(next_value, str) else None)
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(
        auth.SESSION_COOKIE,
        session.sid,
        httponly=True,
        samesite="strict",
        secure=_secure(request),
        path="/",
        max_age=int(console.config.session_hours * 3600),
    )
    response.delete_cookie(auth.LOGIN_COOKIE, path="/login")
    return response


async def logout(request: Request) -> Response:
    console = console_of(request)
    session = console.sessions.of(request)
    if session is not None:
        form = await request.form(max_files=0, max_fields=10)
        if not auth.csrf_ok(session.csrf, form.get("csrf")):
            return problem(request, 403, "refused: the form's CSRF token is missing or wrong")
        console.sessions.end(session)
    response = RedirectResponse("/login" if console.config.login_required else "/runs", 303)
    response.delete_cookie(auth.SESSION_COOKIE, path="/")
    return response


async def home(request: Request) -> Response:
    return RedirectResponse("/runs", status_code=303)


# -- the app ----------------------------------------------------------------------------


def build_app(config: ConsoleConfig) -> Starlette:
    console = Console(
        config=config,
        reader=Reader(config.database_url, config.connect_timeout, keep=config.read_pool),
        hub=Hub(config.database_url, config.connect_timeout),
        sessions=auth.Sessions(config),
        pages=Pages(),
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        console.hub.start()
        if config.allow_actions:
            from runledger.db.operator_store import OperatorStore

            assert config.operator_url is not None
            console.store = await OperatorStore.connect(
                config.operator_url,
                max_size=2,
                application_name="runledger-console",
                connect_timeout=config.connect_timeout,
            )
        try:
            yield
        finally:
            await console.hub.stop()
            if console.store is not None:
                await console.store.close()
            await asyncio.to_thread(console.reader.close)

    routes = [
        Route("/", home),
        Route("/runs", pages.runs_page),
        Route("/runs/{run_id}", pages.run_page),
        Route("/inbox", pages.inbox_page),
        Route("/workers", pages.workers_page),
        Route("/api", pages.api_index),
        Route("/api/runs", pages.runs_api),
        Route("/api/runs/{run_id}", pages.run_api),
        Route("/api/inbox", pages.inbox_api),
        Route("/api/workers", pages.workers_api),
        Route("/api/events", pages.events_api),
        Route("/api/stream", pages.stream_api),
        Route("/login", login_page, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/calls/{key}/resolve", actions.resolve, methods=["POST"]),
        Route("/calls/{key}/approve", actions.approve, methods=["POST"]),
        Route("/calls/{key}/deny", actions.deny, methods=["POST"]),
        Route("/runs/{run_id}/cancel", actions.cancel, methods=["POST"]),
        Route("/runs/{run_id}/retry", actions.retry, methods=["POST"]),
        Mount(
            "/static", app=StaticFiles(packages=[("runledger.console", "static")]), name="static"
        ),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            BadRequest: _bad_request,
            actions.Refused: _refused,
            errors.RunLedgerError: _runledger_error,
            HTTPException: _http_error,
            Exception: _crash,
        },
    )
    app.state.console = console
    app.add_middleware(ReadGate)
    return app
