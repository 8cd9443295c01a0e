"""Client-side checks that the database would refuse anyway, made before a round trip.

PostgreSQL cannot store NUL in ``text`` nor ``\\u0000`` in ``jsonb``; the driver
would fail with a generic error. These turn such values into ``InvalidInput`` with
the name of the offending field, and nothing is sent. Nesting deeper than
:data:`runledger.model.MAX_JSON_DEPTH` is refused here too (the database refuses it as
well), and the walk is iterative: no input can make it raise ``RecursionError``.
"""

from __future__ import annotations

import json
import operator
from enum import StrEnum
from typing import Any, TypeVar

from runledger.errors import InvalidInput
from runledger.model import MAX_JSON_DEPTH, TRACEPARENT_RE

E = TypeVar("E", bound=StrEnum)


def _encodable(what: str, value: str, where: str = "") -> None:
    if "\x00" in value:
        raise InvalidInput(
            f"{what} contains a NUL character{where}", hint="PostgreSQL text cannot hold NUL"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput(f"{what} is not valid Unicode{where}: {exc.reason}") from None


def check_text(
    what: str, value: object, *, max_chars: int | None = None, min_chars: int = 1
) -> None:
    """A string PostgreSQL can store; with ``max_chars``, also ``min_chars`` (1) to
    ``max_chars`` characters."""
    if not isinstance(value, str):
        raise InvalidInput(f"{what} must be a string, got {type(value).__name__}")
    _encodable(what, value)
    if max_chars is not None and not min_chars <= len(value) <= max_chars:
        raise InvalidInput(f"{what} must be {min_chars}-{max_chars} characters, got {len(value)}")


def check_traceparent(value: object) -> None:
    """A W3C ``traceparent`` as ``submit_run_v2`` stores it: version 00, lowercase hex,
    neither the trace id nor the parent id all zeros."""
    check_text("traceparent", value)
    assert isinstance(value, str)
    if (
        TRACEPARENT_RE.fullmatch(value) is None
        or value[3:35] == "0" * 32
        or value[36:52] == "0" * 16
    ):
        raise InvalidInput(
            f"invalid traceparent {value[:100]!r}",
            hint="a W3C traceparent: 00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>, "
            "lowercase, neither id all zeros",
        )


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def check_int32(what: str, value: object) -> int:
    """An integer PostgreSQL's ``integer`` holds; ``bool``, floats (NaN too) and strings
    are refused rather than converted."""
    allowed = f"an integer from {INT32_MIN} to {INT32_MAX} (int32)"
    if isinstance(value, bool):
        raise InvalidInput(f"{what} must be {allowed}, got {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidInput(
            f"{what} must be {allowed}, got {type(value).__name__} {value!r:.40}"
        ) from None
    if not INT32_MIN <= number <= INT32_MAX:
        shown = str(number) if abs(number) < 10**30 else f"a {number.bit_length()}-bit integer"
        raise InvalidInput(f"{what} must be {allowed}, got {shown}")
    return number


def _utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bad_text(value: str) -> bool:
    return "\x00" in value or not (value.isascii() or _utf8(value))


# Where an item of a walked value is: None for the value itself, else (where its
# container is, its key or index). Spelled out (_path) only for a refusal's message.
_At = tuple[Any, str | int] | None

# json.dumps(value, allow_nan=False, ensure_ascii=False), without building an encoder per
# call as dumps does for any argument but the defaults (the worker checks a few values
# per tool call)
_encode = json.JSONEncoder(allow_nan=False, ensure_ascii=False).encode


def _path(at: _At) -> str:
    parts: list[str] = []
    while at is not None:
        at, step = at
        parts.append(f"[{step}]" if isinstance(step, int) else f".{step}")
    return "".join(reversed(parts))


def _walk(what: str, value: Any, max_depth: int) -> None:
    """Every string and key of ``value``, and its nesting, checked without recursion.

    An explicit stack of ``(item, depth, where)``: a value nested a million levels deep
    (or one that contains itself) is refused at level ``max_depth + 1``, never with a
    ``RecursionError``. Depth first, in document order; each object's keys are checked
    before its values. The path of an item is spelled out only for a refusal.
    """
    stack: list[tuple[Any, int, _At]] = [(value, 0, None)]
    pop, push = stack.pop, stack.append
    while stack:
        item, depth, at = pop()
        if isinstance(item, str):
            if _bad_text(item):
                _encodable(what, item, f" at {_path(at) or '$'}")
            continue
        if not isinstance(item, dict | list | tuple):
            continue
        if depth + 1 > max_depth:
            path = _path(at)
            where = path if len(path) <= 60 else path[:57] + "..."
            raise InvalidInput(
                f"{what} nests deeper than the limit of {max_depth} levels of objects and "
                f"arrays (at {where or '$'})"
            )
        if isinstance(item, dict):
            for key in item:
                if not isinstance(key, str):
                    raise InvalidInput(
                        f"{what} has a non-string key at {_path(at) or '$'}: {key!r}"
                    )
                if _bad_text(key):
                    _encodable(f"{what} key", key, f" at {_path(at) or '$'}")
            for key, child in reversed(item.items()):
                push((child, depth + 1, (at, key)))
        else:
            for index in range(len(item) - 1, -1, -1):
                push((item[index], depth + 1, (at, index)))


def check_json(
    what: str,
    value: Any,
    *,
    obj: bool,
    nullable: bool = False,
    cap: int | None = None,
    max_depth: int = MAX_JSON_DEPTH,
) -> str | None:
    """Refuse what ``jsonb`` cannot hold or the contract does not accept: NUL, lone
    surrogates, non-string keys, NaN, values JSON cannot encode, nesting deeper than
    ``max_depth`` (the database's limit), and more than ``cap`` bytes. Returns the
    value's JSON text (``None`` for ``None``), which the store sends as it is."""
    if value is None:
        if not nullable:
            raise InvalidInput(f"{what} must not be null")
        return None
    if obj and not isinstance(value, dict):
        raise InvalidInput(f"{what} must be a JSON object, got {type(value).__name__}")
    _walk(what, value, max_depth)  # first: the encoder below recurses
    try:
        # measured like the database does: octet_length of UTF-8 text
        text = _encode(value)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{what} is not JSON: {exc}") from exc
    if cap is not None and len(text.encode()) > cap:
        raise InvalidInput(f"{what} is over the cap of {cap} bytes")
    return text


def word(what: str, value: str, enum: type[E]) -> E:
    """``value`` as a member of ``enum``, or ``InvalidInput`` naming the allowed words."""
    try:
        return enum(value)
    except ValueError:
        allowed = ", ".join(m.value for m in enum)
        raise InvalidInput(
            f"unknown {what} {value!r}", hint=f"expected one of: {allowed}"
        ) from None
