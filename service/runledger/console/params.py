"""Query parameters and form fields, checked: a bad one is :class:`BadRequest` (HTTP 400
with one line naming it), never a traceback; nothing is read or written for it."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import ImmutableMultiDict

from runledger import errors
from runledger.db.inspect import MAX_LIMIT, Since
from runledger.model import RUN_ID_RE, RunStatus
from runledger.present import parse_since

STATUSES = tuple(str(s) for s in RunStatus)
LIVENESS = ("alive", "silent", "stopped")


class BadRequest(Exception):
    """A parameter the console refuses: ``param`` names it."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def known_only(query: ImmutableMultiDict[str, Any], allowed: Iterable[str]) -> None:
    known = set(allowed)
    for name in query:
        if name not in known:
            raise BadRequest(
                f"unknown parameter {name[:60]!r}; this page takes {', '.join(sorted(known))}",
                param=name,
            )


def one(query: ImmutableMultiDict[str, Any], name: str) -> str | None:
    values = query.getlist(name)
    if len(values) > 1:
        raise BadRequest(f"{name} given {len(values)} times; give it once", param=name)
    if not values or values[0] == "":
        return None
    value: str = values[0]
    return value


def limit(query: ImmutableMultiDict[str, Any], default: int, *, name: str = "limit") -> int:
    text = one(query, name)
    if text is None:
        return default
    try:
        number = int(text)
    except ValueError:
        raise BadRequest(f"{name} must be a whole number, got {text[:40]!r}", param=name) from None
    if not 1 <= number <= MAX_LIMIT:
        raise BadRequest(f"{name} must be from 1 to {MAX_LIMIT}, got {number}", param=name)
    return number


def choices(query: ImmutableMultiDict[str, Any], name: str, allowed: Sequence[str]) -> list[str]:
    picked = [v for v in query.getlist(name) if v != ""]
    for value in picked:
        if value not in allowed:
            raise BadRequest(
                f"{name} {value[:40]!r} is not one of {', '.join(allowed)}", param=name
            )
    return list(dict.fromkeys(picked))


def flow(query: ImmutableMultiDict[str, Any]) -> str | None:
    text = one(query, "flow")
    if text is not None and (text.startswith("@") or text.endswith("@")):
        raise BadRequest("flow: give a name or name@version", param="flow")
    return text


def since(query: ImmutableMultiDict[str, Any]) -> Since | None:
    """``30m``, ``2h``, ``7d``, or an ISO timestamp: the CLI's ``--since``, parsed as it."""
    text = one(query, "since")
    if text is None:
        return None
    try:
        return parse_since(text)
    except ValueError as exc:
        raise BadRequest(f"since: {exc}", param="since") from None


def run_id(value: str, *, param: str = "run") -> str:
    if not RUN_ID_RE.fullmatch(value):
        raise BadRequest(f"{param}: invalid run id {value[:200]!r}", param=param)
    return value


def event_id(query: ImmutableMultiDict[str, Any], name: str) -> int | None:
    text = one(query, name)
    if text is None:
        return None
    if not text.isdigit() or len(text) > 18:
        raise BadRequest(
            f"{name} must be an event id (a whole number), got {text[:40]!r}", param=name
        )
    return int(text)


# -- paging -----------------------------------------------------------------------------
# A page of runs ends with a cursor: the last run's (created_at, run_id), as
# "<ISO time>|<run id>" (no run id holds a "|"). The next page starts after it.


@dataclass(frozen=True, slots=True)
class Cursor:
    created_at: dt.datetime
    run_id: str

    def encode(self) -> str:
        return f"{self.created_at.isoformat()}|{self.run_id}"


def cursor_of(row: dict[str, Any]) -> str:
    return Cursor(dt.datetime.fromisoformat(row["created_at"]), row["run_id"]).encode()


def before(query: ImmutableMultiDict[str, Any]) -> Cursor | None:
    text = one(query, "before")
    if text is None:
        return None
    at, bar, rid = text.partition("|")
    try:
        created = dt.datetime.fromisoformat(at)
    except ValueError:
        created = None
    if not bar or created is None or created.tzinfo is None or not RUN_ID_RE.fullmatch(rid):
        raise BadRequest(
            "before must be the cursor of a page of runs (<ISO time with zone>|<run id>), "
            f"got {text[:80]!r}",
            param="before",
        )
    return Cursor(created, rid)


def refusal(exc: errors.RunLedgerError) -> BadRequest:
    """An :class:`~runledger.errors.InvalidInput` of the store, as a 400."""
    return BadRequest(" ".join(str(exc).split()))
