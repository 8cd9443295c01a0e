"""JSON from the database that Python cannot decode becomes a value, not an exception.

psycopg decodes ``json``/``jsonb`` columns while it fetches the rows, so one value that
``json.loads`` refuses (nested deeper than Python's recursion limit, which only rows
written before the database enforced its nesting limit can be) would make the whole
result set fail: every run of a claim batch, not just the bad one. The loader installed
on runledger's connections returns :class:`Undecodable` for such a value instead, and the
code that reads it decides what to do with that one run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection
from psycopg.types.json import set_json_loads


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A JSON value the database holds and Python could not decode."""

    reason: str
    size: int  # bytes of its text form

    def __str__(self) -> str:
        return f"<undecodable JSON, {self.size} bytes: {self.reason}>"


def safe_loads(data: bytes | bytearray | memoryview | str) -> Any:
    try:
        return json.loads(data if isinstance(data, str) else bytes(data))
    except RecursionError:
        return Undecodable(reason="nested too deeply for Python to decode", size=len(data))
    except ValueError as exc:  # not expected from PostgreSQL; never fail a whole batch
        return Undecodable(reason=f"invalid JSON: {exc}", size=len(data))


def is_undecodable(value: object) -> bool:
    return isinstance(value, Undecodable)


async def configure(conn: AsyncConnection[Any]) -> None:
    """The pool's ``configure`` hook: every runledger connection decodes JSON safely."""
    set_json_loads(safe_loads, conn)
