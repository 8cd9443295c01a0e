"""Runs this worker cannot decode: found, named, and dealt with alone.

The store's connections decode JSON that Python cannot (nested deeper than its
recursion limit, which only rows written before the database enforced its nesting
limit can be) as a :class:`~runledger.db.decode.Undecodable` value instead of failing
the whole result set. Such a value anywhere in a run's input, state or journal means
this code cannot drive the run: the executor fails it (or pauses it, when a call of it
may be in flight) with reason ``undecodable_run``, and the other runs of the claim
batch go on. No I/O here: the search is a pure function of what was loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from runledger.db.decode import Undecodable, is_undecodable
from runledger.model import Call, Turn

__all__ = ["Found", "UndecodableRun", "in_calls", "in_turns", "in_value"]

MAX_FOUND = 10  # named in the run's error; the rest are counted
_MAX_PATH = 200

# a path is built only for what is found: (key, parent) links, rendered on demand
_Link = tuple[str, "_Link"] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Found:
    """One value Python could not decode, and where it is."""

    at: str  # e.g. "input", "state.history[3]", "call r:0:c0 args"
    error: str
    size: int  # bytes of its text form

    def as_json(self) -> dict[str, Any]:
        return {"at": self.at, "error": self.error, "bytes": self.size}


class UndecodableRun(Exception):
    """The run's ``what`` (``input``, ``state`` or ``journal``) holds undecodable JSON."""

    def __init__(self, what: str, found: list[Found]) -> None:
        super().__init__(f"{what} cannot be decoded: {', '.join(f.at for f in found)}")
        self.what = what
        self.found = found

    def detail(self) -> dict[str, Any]:
        """What the run's error records (``finish_run`` adds ``reason``)."""
        named = self.found[:MAX_FOUND]
        out: dict[str, Any] = {"what": self.what, "found": [f.as_json() for f in named]}
        if len(self.found) > len(named):
            out["more"] = len(self.found) - len(named)
        return out


def _render(link: _Link) -> str:
    parts: list[str] = []
    while link is not None:
        key, link = link
        parts.append(key)
    path = "".join(reversed(parts))
    return path if len(path) <= _MAX_PATH else path[: _MAX_PATH - 3] + "..."


def _walk(value: Any, root: str) -> Iterator[Found]:
    """Every undecodable value inside ``value``; iterative, so any depth is fine."""
    stack: list[tuple[Any, _Link]] = [(value, (root, None))]
    while stack:
        item, link = stack.pop()
        if is_undecodable(item):
            assert isinstance(item, Undecodable)
            yield Found(at=_render(link), error=item.reason, size=item.size)
        elif isinstance(item, dict):
            stack.extend((v, (f".{k}", link)) for k, v in reversed(item.items()))
        elif isinstance(item, list | tuple):
            stack.extend((v, (f"[{i}]", link)) for i, v in reversed(list(enumerate(item))))


def in_value(value: Any, root: str) -> list[Found]:
    """The undecodable values in one loaded JSON value (``root`` names it)."""
    return list(_walk(value, root))


def in_turns(turns: Iterable[Turn]) -> list[Found]:
    """The undecodable values in recorded turns (their ``calls``, ``record`` and ``output``)."""
    return [
        f
        for t in turns
        for name, value in (("calls", t.calls), ("record", t.record), ("output", t.output))
        for f in _walk(value, f"turn {t.turn} {name}")
    ]


def in_calls(calls: Iterable[Call]) -> list[Found]:
    """The undecodable values in calls: their args, results, receipts and errors."""
    found: list[Found] = []
    for c in calls:
        for name, value in (
            ("args", c.args),
            ("result", c.result),
            ("receipt", c.receipt),
            ("error", c.error),
        ):
            found.extend(_walk(value, f"call {c.idempotency_key} {name}"))
    return found
