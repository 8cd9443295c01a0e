"""Client-side checks that the database would refuse anyway, made before a round trip.

PostgreSQL cannot store NUL in ``text`` nor ``\\u0000`` in ``jsonb``; the driver
would fail with a generic error. These turn such values into ``InvalidInput`` with
the name of the offending field, and nothing is sent.
"""

from __future__ import annotations

import json
from typing import Any

from runledger.errors import InvalidInput


def _encodable(what: str, value: str, where: str = "") -> None:
    if "\x00" in value:
        raise InvalidInput(
            f"{what} contains a NUL character{where}", hint="PostgreSQL text cannot hold NUL"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput(f"{what} is not valid Unicode{where}: {exc.reason}") from None


def check_text(what: str, value: object, *, max_chars: int | None = None) -> None:
    """A string PostgreSQL can store; with ``max_chars``, also 1 to ``max_chars`` characters."""
    if not isinstance(value, str):
        raise InvalidInput(f"{what} must be a string, got {type(value).__name__}")
    _encodable(what, value)
    if max_chars is not None and not 1 <= len(value) <= max_chars:
        raise InvalidInput(f"{what} must be 1-{max_chars} characters, got {len(value)}")


def _walk(what: str, value: Any, path: str) -> None:
    if isinstance(value, str):
        _encodable(what, value, f" at {path or '$'}")
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidInput(f"{what} has a non-string key at {path or '$'}: {key!r}")
            _encodable(f"{what} key", key, f" at {path or '$'}")
            _walk(what, item, f"{path}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _walk(what, item, f"{path}[{i}]")


def check_json(
    what: str, value: Any, *, obj: bool, nullable: bool = False, cap: int | None = None
) -> None:
    """Refuse what ``jsonb`` cannot hold or the contract does not accept."""
    if value is None:
        if not nullable:
            raise InvalidInput(f"{what} must not be null")
        return
    if obj and not isinstance(value, dict):
        raise InvalidInput(f"{what} must be a JSON object, got {type(value).__name__}")
    _walk(what, value, "")
    try:
        # measured like the database does: octet_length of UTF-8 text
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{what} is not JSON: {exc}") from exc
    if cap is not None and len(text.encode()) > cap:
        raise InvalidInput(f"{what} is over the cap of {cap} bytes")
