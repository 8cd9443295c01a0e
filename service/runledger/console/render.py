"""The templates (package data, Jinja2, autoescaped) and their filters: times by the
database clock, calls and events shown as the CLI shows them (:mod:`runledger.present`)."""

from __future__ import annotations

import json
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse

from runledger.present import (
    age,
    ago,
    call_error,
    compact,
    event_line,
    evidence_lines,
    expiry,
    when,
)

STATUS_CLASS = {
    "queued": "st-queued",
    "running": "st-running",
    "paused": "st-paused",
    "succeeded": "st-ok",
    "failed": "st-bad",
    "cancelled": "st-off",
    "unknown": "st-paused",
    "planned": "st-queued",
    "dispatched": "st-running",
    "alive": "st-ok",
    "silent": "st-paused",
    "stopped": "st-off",
}


def _pretty(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, indent=2, ensure_ascii=False, default=str, sort_keys=True)


def _ago_or_blank(at: str | None, now: str) -> str:
    return ago(now, at)


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("runledger.console", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        when=when,
        ago=_ago_or_blank,
        age=age,
        expiry=expiry,
        compact=compact,
        call_error=call_error,
        evidence_lines=evidence_lines,
        pretty=_pretty,
        event_line=event_line,
        status_class=lambda s: STATUS_CLASS.get(str(s), ""),
    )
    return env


class Pages:
    def __init__(self) -> None:
        self.env = environment()

    def render(
        self, request: Request, name: str, context: dict[str, Any], *, status: int = 200
    ) -> HTMLResponse:
        fragment = request.query_params.get("fragment") == "1"
        html = self.env.get_template(name).render(
            {**context, "fragment": fragment, "path": request.url.path}
        )
        return HTMLResponse(
            html,
            status_code=status,
            headers={
                "Cache-Control": "no-store",
                "Content-Security-Policy": CSP,
                "X-Frame-Options": "DENY",
                "Referrer-Policy": "same-origin",
                "X-Content-Type-Options": "nosniff",
            },
        )


# Scripts and styles from this server only; no inline script; framing refused.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
