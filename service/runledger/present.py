"""How runs, calls, events and times are shown: the one place the CLI and the console share.

Plain text in, plain text out: no click, no rich, no HTML. The ``runledger`` command
prints these strings (:mod:`runledger.cli`); the console (:mod:`runledger.console`) uses
them as its templates' filters and offers the same command lines. The console never
imports the CLI.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import TYPE_CHECKING, Any

from runledger.model import Approval, Call

if TYPE_CHECKING:
    from runledger.db.inspect import Since

# -- times ------------------------------------------------------------------------------


def when(at: str | None) -> str:
    """An ISO time, shorter: ``2026-12-01 15:23:15.463Z`` (UTC)."""
    if at is None:
        return ""
    t = dt.datetime.fromisoformat(at).astimezone(dt.UTC)
    return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def age(seconds: float | None) -> str:
    """``42s``, ``3m 5s``, ``2h 10m``, ``3d 4h``."""
    if seconds is None:
        return ""
    s = int(abs(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def ago(now: str, at: str | None) -> str:
    """How long before ``now`` (the database's, as the read returned it) ``at`` was."""
    if at is None:
        return ""
    delta = dt.datetime.fromisoformat(now) - dt.datetime.fromisoformat(at)
    return age(delta.total_seconds()) + " ago"


def expiry(seconds: float | None) -> str:
    """A lease's time left: ``expires in 12s``, or ``expired 3m 5s ago``."""
    if seconds is None:
        return ""
    return f"expires in {age(seconds)}" if seconds > 0 else f"expired {age(seconds)} ago"


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|h|d)")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(value: Any) -> Since:
    """``30m``, ``2h``, ``7d``, ``90s`` (before the database's now), or an ISO 8601
    timestamp (without a zone: UTC), as ``--since`` and the console's ``since`` take it.
    Anything else is ``ValueError`` with the sentence to show."""
    from runledger.db.inspect import Since

    text = str(value).strip()
    m = _DURATION.fullmatch(text)
    if m:
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
        if seconds > 100 * 365 * 86400:
            raise ValueError(f"{value!r} is more than a hundred years.")
        return Since(ago=dt.timedelta(seconds=seconds))
    try:
        at = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"{value!r} is neither a duration (30m, 2h, 7d) nor an ISO timestamp "
            "(2026-12-01T15:00:00Z)."
        ) from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=dt.UTC)
    return Since(at=at)


# -- values, calls, events --------------------------------------------------------------


def compact(value: Any) -> str:
    """A JSON value on one line (``""`` for none)."""
    return "" if value is None else json.dumps(value, default=str, ensure_ascii=False)


ERROR_CHARS = 200  # a call's error in a table, a line or a page; --json has it whole


def call_error(error: Any, limit: int = ERROR_CHARS) -> str:
    """A call's error on one line, for the person who must decide what to do with it:
    why (its ``reason``), then the tool's exception (``type: message``), then a person's
    ``note``: ``retries exhausted: RuntimeError: ticket service exploded``. Whitespace
    is collapsed and the text cut at ``limit`` characters with an ellipsis."""
    if error is None:
        return ""
    if isinstance(error, dict):
        parts = [] if error.get("reason") in (None, "") else [str(error["reason"])]
        kind, message = error.get("type"), error.get("message")
        if kind not in (None, ""):
            parts.append(f"{kind}: {message}" if message not in (None, "") else str(kind))
        elif message not in (None, ""):
            parts.append(str(message))
        if error.get("note") not in (None, ""):
            parts.append(str(error["note"]))
        text = ": ".join(parts) if parts else compact(error)
    elif isinstance(error, list | int | float | bool):
        text = compact(error)
    else:  # a string as it is; JSON Python could not decode, described
        text = str(error)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


EVIDENCE_CHARS = 300  # one step of a call's evidence on one line


def evidence_lines(error: Any, limit: int = EVIDENCE_CHARS) -> list[str]:
    """What the call's last holder learned before it gave the call up as unknown
    (``error.evidence``: each send, lookup and earlier sender waited for), one line per
    step, oldest first: ``lookup #2 at 10:38:01.204 (35 ms): saw not_found; asked: GET
    /orders?...``. None when the error has no evidence."""
    steps = error.get("evidence") if isinstance(error, dict) else None
    if not isinstance(steps, list):
        return []
    lines = []
    for step in steps:
        if not isinstance(step, dict):
            lines.append(compact(step)[:limit])
            continue
        head = str(step.get("step", "step"))
        if step.get("attempt") is not None:
            head += f" #{step['attempt']}"
        if step.get("at"):
            head += f" at {step['at']}"
        if step.get("ms") is not None:
            head += f" ({step['ms']} ms)"
        parts = []
        for name in ("ended", "saw", "reason", "worker", "fencing_token", "sent_at"):
            if step.get(name) not in (None, ""):
                parts.append(f"{name} {step[name]}")
        if isinstance(step.get("error"), dict):
            parts.append(call_error(step["error"], limit))
        for fact in step.get("observed") or []:
            if isinstance(fact, dict):
                parts.append(
                    ", ".join(
                        f"{k}: {compact(v) if not isinstance(v, str) else v}"
                        for k, v in fact.items()
                    )
                )
            else:
                parts.append(compact(fact))
        text = " ".join((head + ": " + "; ".join(parts)).split())
        lines.append(text if len(text) <= limit else text[: limit - 1].rstrip() + "…")
    return lines


_SHOWN = {
    Approval.PENDING: "awaiting approval",
    Approval.APPROVED: "approved",
    Approval.DENIED: "denied",
}


def shown_status(call: Call) -> str:
    """A call's status with its approval, if it has one: ``planned (awaiting approval)``."""
    if call.approval is None:
        return str(call.status)
    return f"{call.status} ({_SHOWN[call.approval]})"


def event_line(e: dict[str, Any], *, run: bool = True) -> str:
    """``#12 2026-12-01 15:23:15.464Z ticket-77 claimed by worker-a token=1 lease_id=...``:
    the detail as key=value pairs, each value whole."""
    token = f" token={e['fencing_token']}" if e["fencing_token"] is not None else ""
    actor = f" by {e['actor']}" if e["actor"] else ""
    detail = e["detail"]
    if isinstance(detail, dict):
        pairs = " ".join(
            f"{k}={v if isinstance(v, str) and v and ' ' not in v else compact(v)}"
            for k, v in detail.items()
        )
    else:
        pairs = compact(detail)
    where = f" {e['run_id']}" if run else ""
    return f"#{e['event_id']} {when(e['at'])}{where} {e['kind']}{actor}{token}" + (
        f" {pairs}" if pairs else ""
    )


# -- the command lines that settle a call waiting for a person ---------------------------

RESOLVABLE = ("paused", "cancelled", "failed")  # the run states resolve_call accepts
APPROVABLE = ("queued", "paused", "cancelled", "failed")  # runs approve_call/deny_call accept


def resolve_command(key: str) -> str:
    """The line an operator runs for an unknown call (printed whole by ``status``)."""
    return f"runledger resolve {key} applied|not_applied|abandoned"


def approval_lines(key: str) -> tuple[str, str]:
    """The two lines ``runledger status`` prints (whole) for a call awaiting approval."""
    return f"runledger approve {key}", f'runledger deny {key} --reason "..."'


def commands_for(call: dict[str, Any], run_status: str) -> tuple[list[str], str | None]:
    """The lines that act on a call waiting for a person, or why none works yet
    (``runledger show`` and ``unknown``, and the console's run and inbox pages)."""
    key = call["idempotency_key"]
    if call["status"] == "unknown":
        if run_status in RESOLVABLE:
            return [resolve_command(key)], None
        return (
            [],
            "the run is running: its worker pauses it (or, its lease expired, the worker "
            "that takes it over does); resolve it then",
        )
    if run_status in APPROVABLE:
        return list(approval_lines(key)), None
    return [], "the run is running: it pauses when its worker reaches the call; decide then"
