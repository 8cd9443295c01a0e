"""The operator's actions: resolve, approve, deny, cancel, retry.

Only with ``--allow-actions``; only for a signed-in session (its CSRF token in the form,
and no ``Origin`` of another site); each through the operator-role
:class:`~runledger.db.store.Store` that :class:`runledger.client.Client` drives too, so
each is one contract function (``resolve_call``, ``approve_call``, ``deny_call``,
``cancel_run``, ``retry_run``) and records the session's actor in the call and in
``run_events``. A form that does not check out is refused (400) before anything is
sent; a refusal of the database is shown as it is (409 for a call or run in the wrong
state, 404 for one that does not exist). Success goes back to the run's page (303).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from runledger import errors
from runledger.console import auth, params
from runledger.console.state import console_of
from runledger.model import MAX_JSON_DEPTH

RESOLUTIONS = ("applied", "not_applied", "abandoned")
MAX_FORM_BYTES = 2 * 1024 * 1024


class Refused(Exception):
    """The request may not act: ``status`` 403 (actions off, not signed in, CSRF) or 401."""

    def __init__(self, status: int, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.hint = hint


async def _form(request: Request) -> tuple[Any, FormData]:
    console = console_of(request)
    if not console.config.allow_actions:
        raise Refused(
            403,
            "actions are off: this console is read-only",
            "start it with runledger console --allow-actions (and an operator URL and "
            "RUNLEDGER_CONSOLE_TOKEN) to act here",
        )
    session = console.sessions.of(request)
    if session is None:
        raise Refused(401, "sign in first: every action is recorded under your name")
    if not auth.same_origin(request):
        raise Refused(403, "refused: the form was posted from another site")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_FORM_BYTES:
        raise params.BadRequest(f"the form is over {MAX_FORM_BYTES} bytes")
    form = await request.form(max_files=0, max_fields=20)
    if not auth.csrf_ok(session.csrf, form.get("csrf")):
        raise Refused(403, "refused: the form's CSRF token is missing or wrong; reload the page")
    return session, form


def _text(form: FormData, name: str, *, required: bool = False) -> str | None:
    value = form.get(name)
    if value is None or value == "":
        if required:
            raise params.BadRequest(f"{name} is required", param=name)
        return None
    if not isinstance(value, str):
        raise params.BadRequest(f"{name} must be text", param=name)
    return value


def _receipt(text: str | None) -> dict[str, Any] | None:
    """The receipt field as the CLI's ``--receipt`` takes it: a JSON object, or nothing."""
    from runledger.db.validate import check_json

    if text is None or not text.strip():
        return None
    try:
        value = json.loads(text)
    except RecursionError:
        raise params.BadRequest(
            f"receipt nests deeper than the limit of {MAX_JSON_DEPTH} levels", param="receipt"
        ) from None
    except ValueError as exc:
        raise params.BadRequest(f"receipt is not JSON: {exc}", param="receipt") from None
    try:
        check_json("receipt", value, obj=True)
    except errors.InvalidInput as exc:
        raise params.BadRequest(" ".join(str(exc).split()), param="receipt") from None
    receipt: dict[str, Any] = value
    return receipt


def _run_of(key: str) -> str:
    return key.rsplit(":", 2)[0]  # keys are {run_id}:{turn}:{call_id}


async def _act(
    request: Request,
    run_id: str,
    do: Callable[[Any, Any, FormData], Awaitable[str]],
) -> Response:
    session, form = await _form(request)
    store = console_of(request).store
    done = await do(store, session, form)
    session.flash.append(("ok", done))
    return RedirectResponse("/runs/" + quote(run_id, safe=""), status_code=303)


async def resolve(request: Request) -> Response:
    key = request.path_params["key"]

    async def do(store: Any, session: Any, form: FormData) -> str:
        resolution = _text(form, "resolution", required=True)
        if resolution not in RESOLUTIONS:
            raise params.BadRequest(
                f"resolution must be one of {', '.join(RESOLUTIONS)}", param="resolution"
            )
        receipt = _receipt(_text(form, "receipt"))
        if receipt is not None and resolution != "applied":
            raise params.BadRequest(
                "a receipt goes with 'applied' only (the call has no result otherwise)",
                param="receipt",
            )
        note = _text(form, "note")
        await store.resolve_call(key, resolution, receipt, session.actor, note)
        return f"{key} resolved as {resolution} by {session.actor}"

    return await _act(request, _run_of(key), do)


async def approve(request: Request) -> Response:
    key = request.path_params["key"]

    async def do(store: Any, session: Any, form: FormData) -> str:
        await store.approve_call(key, actor=session.actor, note=_text(form, "note"))
        return f"{key} approved by {session.actor}"

    return await _act(request, _run_of(key), do)


async def deny(request: Request) -> Response:
    key = request.path_params["key"]

    async def do(store: Any, session: Any, form: FormData) -> str:
        reason = _text(form, "reason", required=True)
        assert reason is not None
        await store.deny_call(key, reason=reason, actor=session.actor)
        return f"{key} denied by {session.actor}"

    return await _act(request, _run_of(key), do)


async def cancel(request: Request) -> Response:
    run_id = request.path_params["run_id"]

    async def do(store: Any, session: Any, form: FormData) -> str:
        params.run_id(run_id, param="run id")
        await store.cancel_run(run_id, session.actor, _text(form, "reason"))
        return f"{run_id} cancelled by {session.actor}"

    return await _act(request, run_id, do)


async def retry(request: Request) -> Response:
    run_id = request.path_params["run_id"]

    async def do(store: Any, session: Any, form: FormData) -> str:
        params.run_id(run_id, param="run id")
        await store.retry_run(run_id, session.actor)
        return f"{run_id} queued again by {session.actor}"

    return await _act(request, run_id, do)
