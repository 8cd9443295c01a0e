"""The read pages and the ``/api`` JSON they show: one loader per page, both shapes.

Each loader calls the CLI's query (:mod:`runledger.db.inspect`,
:mod:`runledger.db.event_log`) with checked parameters, so ``/api/runs`` is what
``runledger list --json`` prints, ``/api/runs/{id}`` what ``runledger show --json``
prints (plus each turn's decision ``record`` and ``output``), ``/api/inbox`` what
``runledger unknown --json`` prints and ``/api/workers`` what ``runledger workers --json``
prints.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from runledger.console import params
from runledger.console.redact import shown_run
from runledger.console.state import Console, console_of
from runledger.db import event_log, inspect
from runledger.present import commands_for

RUNS_PARAMS = ("status", "flow", "since", "limit", "before")
INBOX_PARAMS = ("include_finished", "limit")
WORKERS_PARAMS = ("liveness", "limit")
EVENTS_PARAMS = ("run", "kind", "since", "limit", "until")
PAGE = ("fragment",)
INBOX_PAGE = 200
CANCELLABLE = ("queued", "running", "paused")
RETRYABLE = ("failed", "paused")


def api_json(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(data, status_code=status, headers={"Cache-Control": "no-store"})


# -- runs -------------------------------------------------------------------------------


async def load_runs(console: Console, request: Request, *, page: bool) -> dict[str, Any]:
    q = request.query_params
    params.known_only(q, RUNS_PARAMS + (PAGE if page else ()))
    statuses = params.choices(q, "status", params.STATUSES)
    flow = params.flow(q)
    since = params.since(q)
    limit = params.limit(q, console.config.page_size)
    before = params.before(q)
    data: dict[str, Any] = await console.reader(
        inspect.list_runs,
        statuses=statuses,
        flow=flow,
        since=since,
        limit=min(limit + 1, inspect.MAX_LIMIT),  # one more: is there an older page?
        silent_after=console.config.silent_after,
        before=None if before is None else (before.created_at, before.run_id),
    )
    more = len(data["runs"]) > limit
    data["runs"] = data["runs"][:limit]
    keep = [(k, v) for k, v in q.multi_items() if k in RUNS_PARAMS and k != "before" and v]
    data["next"] = params.cursor_of(data["runs"][-1]) if more and data["runs"] else None
    data["next_url"] = (
        "/runs?" + urlencode([*keep, ("before", data["next"])]) if data["next"] else None
    )
    data["filters"] = {
        "statuses": statuses,
        "flow": flow,
        "since": params.one(q, "since"),
        "limit": limit,
        "before": params.one(q, "before"),
    }
    data["first_url"] = "/runs" + ("?" + urlencode(keep) if keep else "")
    return data


async def runs_page(request: Request) -> Response:
    console = console_of(request)
    data = await load_runs(console, request, page=True)
    return console.pages.render(
        request,
        "runs.html",
        console.context(
            request,
            nav="runs",
            data=data,
            filters=data["filters"],
            statuses=params.STATUSES,
            next_url=data["next_url"],
            first_url=data["first_url"],
        ),
    )


async def runs_api(request: Request) -> Response:
    data = await load_runs(console_of(request), request, page=False)
    data.pop("first_url")
    data["next_url"] = data["next_url"] and "/api" + data["next_url"]
    return api_json(data)


# -- one run ----------------------------------------------------------------------------


async def load_run(console: Console, request: Request, *, page: bool) -> dict[str, Any]:
    params.known_only(request.query_params, PAGE if page else ())
    run_id = params.run_id(request.path_params["run_id"], param="run id")
    data: dict[str, Any] = await console.reader(
        inspect.show_run, run_id, silent_after=console.config.silent_after, records=True
    )
    return shown_run(data) if console.config.redact else data


def call_actions(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """For each call of the run: ``kind`` (``resolve``, ``decide`` or None) and the CLI
    lines and note of ``runledger show`` (:func:`runledger.present.commands_for`)."""
    status = data["run"]["status"]
    found: dict[str, dict[str, Any]] = {}
    for turn in data["turns"]:
        for call in turn["calls"]:
            kind = None
            commands: list[str] = []
            note = None
            if call["status"] == "unknown" or (
                call["approval"] == "pending" and call["status"] == "planned"
            ):
                commands, note = commands_for(call, status)
                if commands:
                    kind = "resolve" if call["status"] == "unknown" else "decide"
            found[call["idempotency_key"]] = {
                "kind": kind or ("note" if note else None),
                "commands": commands,
                "note": note,
            }
    return found


def run_actions(status: str) -> list[str]:
    return [a for a, ok in (("cancel", CANCELLABLE), ("retry", RETRYABLE)) if status in ok]


async def run_page(request: Request) -> Response:
    console = console_of(request)
    data = await load_run(console, request, page=True)
    return console.pages.render(
        request,
        "run.html",
        console.context(
            request,
            nav="runs",
            live_run=data["run"]["run_id"],
            now=data["now"],
            run=data["run"],
            lease=data["lease"],
            turns=data["turns"],
            timeline=data["timeline"],
            timeline_truncated=data["timeline_truncated"],
            call_actions=call_actions(data),
            run_actions=run_actions(data["run"]["status"]),
        ),
    )


async def run_api(request: Request) -> Response:
    return api_json(await load_run(console_of(request), request, page=False))


# -- inbox ------------------------------------------------------------------------------


def _flag(request: Request, name: str) -> bool:
    text = params.one(request.query_params, name)
    if text is None or text in ("0", "false", "no"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise params.BadRequest(f"{name} must be 1 or 0, got {text[:40]!r}", param=name)


async def load_inbox(console: Console, request: Request, *, page: bool) -> dict[str, Any]:
    params.known_only(request.query_params, INBOX_PARAMS + (PAGE if page else ()))
    include_finished = _flag(request, "include_finished")
    # the page shows the oldest 200 by default (1,000 rows make a half-megabyte page);
    # /api/inbox the 1,000 of `runledger unknown --json`
    limit = params.limit(request.query_params, INBOX_PAGE if page else 1000)
    data: dict[str, Any] = await console.reader(
        inspect.waiting_calls, include_finished=include_finished, limit=limit
    )
    for c in data["calls"]:  # as `runledger unknown --json` adds them
        c["commands"], c["note"] = commands_for(c, c["run_status"])
    data["include_finished"] = include_finished
    data["limit"] = limit
    return data


async def inbox_page(request: Request) -> Response:
    console = console_of(request)
    data = await load_inbox(console, request, page=True)
    return console.pages.render(
        request,
        "inbox.html",
        console.context(request, nav="inbox", data=data, include_finished=data["include_finished"]),
    )


async def inbox_api(request: Request) -> Response:
    return api_json(await load_inbox(console_of(request), request, page=False))


# -- workers ----------------------------------------------------------------------------


async def load_workers(console: Console, request: Request, *, page: bool) -> dict[str, Any]:
    q = request.query_params
    params.known_only(q, WORKERS_PARAMS + (PAGE if page else ()))
    liveness = params.choices(q, "liveness", params.LIVENESS)
    limit = params.limit(q, 50)
    data: dict[str, Any] = await console.reader(
        inspect.workers, silent_after=console.config.silent_after, liveness=liveness, limit=limit
    )
    return data


async def workers_page(request: Request) -> Response:
    console = console_of(request)
    data = await load_workers(console, request, page=True)
    # heartbeats send no notification: the page also refreshes every 5 s
    return console.pages.render(
        request, "workers.html", console.context(request, nav="workers", data=data, poll=5)
    )


async def workers_api(request: Request) -> Response:
    return api_json(await load_workers(console_of(request), request, page=False))


# -- events and the live stream ---------------------------------------------------------


async def events_api(request: Request) -> Response:
    console = console_of(request)
    q = request.query_params
    params.known_only(q, EVENTS_PARAMS)
    run = params.one(q, "run")
    rows = await console.reader(
        event_log.events,
        run_id=None if run is None else params.run_id(run),
        kinds=[k for k in q.getlist("kind") if k],
        since=params.since(q),
        limit=params.limit(q, 50),
        until=params.event_id(q, "until"),
    )
    return api_json({"events": rows})


async def stream_api(request: Request) -> Response:
    console = console_of(request)
    params.known_only(request.query_params, ("run",))
    run = params.one(request.query_params, "run")
    run_id = None if run is None else params.run_id(run)
    return StreamingResponse(
        console.hub.stream(run_id),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


API_INDEX = {
    "GET /api/runs": "runs, newest first: ?status=S (repeatable) &flow=F[@V] &since=2h "
    "&limit=N &before=CURSOR (the 'next' of the previous page)",
    "GET /api/runs/{run_id}": "one run whole: run, lease, turns (record, output, calls), timeline",
    "GET /api/inbox": "calls waiting for a person: ?include_finished=1 &limit=N",
    "GET /api/workers": "workers: ?liveness=alive|silent|stopped (repeatable) &limit=N",
    "GET /api/events": "events, oldest first: ?run=ID &kind=K (repeatable) &since &limit "
    "&until=EVENT_ID",
    "GET /api/stream": "server-sent events: change {event_id, run_id, kind}, ready, resync, "
    "offline, replica {poll} (a standby: no live updates); ?run=ID for one run's",
}


async def api_index(request: Request) -> Response:
    config = console_of(request).config
    return api_json(
        {
            "endpoints": API_INDEX,
            "actions": config.allow_actions,
            "redact": config.redact,
            "docs": "docs/console.md",
        }
    )
