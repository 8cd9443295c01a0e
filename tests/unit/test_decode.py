"""runledger.db.decode: a value Python cannot decode is a value, never an exception."""

from __future__ import annotations

from runledger.db.decode import Undecodable, is_undecodable, safe_loads


def test_ordinary_json_round_trips() -> None:
    assert safe_loads(b'{"a": [1, 2, {"b": null}]}') == {"a": [1, 2, {"b": None}]}
    assert safe_loads('"text"') == "text"


def test_json_nested_past_the_recursion_limit_is_undecodable() -> None:
    deep = "[" * 5000 + "]" * 5000
    value = safe_loads(deep.encode())
    assert isinstance(value, Undecodable) and is_undecodable(value)
    assert value.size == 10000
    assert "nested too deeply" in str(value)


def test_invalid_text_is_undecodable_not_an_error() -> None:
    value = safe_loads(b"{not json")
    assert isinstance(value, Undecodable)
    assert value.reason.startswith("invalid JSON")
