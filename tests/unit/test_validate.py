"""runledger.db.validate: what jsonb/text cannot hold is refused before a round trip."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runledger.db.validate import check_json, check_text
from runledger.errors import InvalidInput

# -- text ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["", "run-1", "é😀", "a\nb", "x" * 10_000])
def test_check_text_accepts_strings(value: str) -> None:
    check_text("run id", value)


@pytest.mark.parametrize("value", ["\x00", "a\x00", "\x00b", "a\x00b"])
def test_check_text_refuses_nul(value: str) -> None:
    with pytest.raises(InvalidInput, match="run id contains a NUL character") as info:
        check_text("run id", value)
    assert info.value.hint == "PostgreSQL text cannot hold NUL"


@pytest.mark.parametrize("value", [None, 1, b"bytes", ["a"]])
def test_check_text_refuses_non_strings(value: object) -> None:
    with pytest.raises(InvalidInput, match="actor must be a string"):
        check_text("actor", value)


@given(st.text())
def test_check_text_refuses_exactly_the_strings_with_nul(value: str) -> None:
    try:
        check_text("note", value)
    except InvalidInput:
        assert "\x00" in value
    else:
        assert "\x00" not in value


def test_check_text_refuses_lone_surrogates() -> None:
    with pytest.raises(InvalidInput):
        check_text("note", "a\ud800")


# -- JSON: shape -------------------------------------------------------------------------------


def test_null_is_refused_unless_nullable() -> None:
    with pytest.raises(InvalidInput, match="input must not be null"):
        check_json("input", None, obj=True)
    check_json("result", None, obj=False, nullable=True)


@pytest.mark.parametrize("value", [[], [1], "s", 1, 1.5, True])
def test_non_object_is_refused_where_an_object_is_required(value: Any) -> None:
    with pytest.raises(InvalidInput, match="input must be a JSON object"):
        check_json("input", value, obj=True)


@pytest.mark.parametrize("value", [[], [1, "a"], "s", 1, 1.5, True, False, {}])
def test_any_json_value_is_accepted_where_no_object_is_required(value: Any) -> None:
    check_json("result", value, obj=False)


def test_tuples_are_json_arrays() -> None:
    check_json("calls", ({"call_id": "c1"},), obj=False)


# -- JSON: NUL anywhere ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ({"a": "x\x00"}, ".a"),
        ({"a": {"b": ["ok", "\x00"]}}, ".a.b[1]"),
        ({"a": [{"b": [{"c": "\x00y"}]}]}, ".a[0].b[0].c"),
    ],
)
def test_nul_in_nested_values_is_refused_with_its_path(value: Any, where: str) -> None:
    with pytest.raises(InvalidInput, match="input contains a NUL character") as info:
        check_json("input", value, obj=True)
    assert info.value.message.endswith(f"at {where}")


@pytest.mark.parametrize("value", [{"k\x00": 1}, {"a": {"\x00": 1}}, {"a": [{"b\x00c": None}]}])
def test_nul_in_nested_keys_is_refused(value: Any) -> None:
    with pytest.raises(InvalidInput, match="input key contains a NUL character"):
        check_json("input", value, obj=True)


def test_nul_in_a_top_level_string_is_refused() -> None:
    with pytest.raises(InvalidInput, match=r"result contains a NUL character at \$"):
        check_json("result", "\x00", obj=False)


@pytest.mark.parametrize("value", [{1: "a"}, {"a": {None: 1}}, {"a": [{(1, 2): 3}]}])
def test_non_string_keys_are_refused(value: Any) -> None:
    # json.dumps would silently turn 1 into "1": the stored input would differ from
    # what the caller holds, and resubmitting the same run would then conflict.
    with pytest.raises(InvalidInput, match="non-string key"):
        check_json("input", value, obj=True)


# -- JSON: numbers and types -----------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        {"x": math.nan},
        {"x": math.inf},
        {"x": -math.inf},
        {"a": [1, {"b": float("nan")}]},
    ],
)
def test_nan_and_infinity_are_refused(value: Any) -> None:
    with pytest.raises(InvalidInput, match="input is not JSON"):
        check_json("input", value, obj=True)


@pytest.mark.parametrize("value", [{"x": {1, 2}}, {"x": object()}, {"x": b"bytes"}])
def test_values_json_cannot_encode_are_refused(value: Any) -> None:
    with pytest.raises(InvalidInput, match="input is not JSON") as info:
        check_json("input", value, obj=True)
    assert info.value.__cause__ is not None


# -- JSON: size cap --------------------------------------------------------------------------


def _size(value: Any) -> int:
    return len(json.dumps(value).encode())


def test_cap_is_inclusive() -> None:
    value = {"text": "a" * 2000}
    check_json("input", value, obj=True, cap=_size(value))
    with pytest.raises(InvalidInput, match=f"input is over the cap of {_size(value) - 1} bytes"):
        check_json("input", value, obj=True, cap=_size(value) - 1)


def test_no_cap_means_no_limit() -> None:
    check_json("input", {"text": "a" * 2_000_000}, obj=True, cap=None)


def test_cap_applies_to_nested_payloads() -> None:
    value = {"a": [{"b": "x" * 600}, {"c": "y" * 600}]}
    with pytest.raises(InvalidInput, match="over the cap"):
        check_json("state", value, obj=True, cap=1024)


def test_cap_counts_utf8_bytes_like_the_database() -> None:
    value = {"a": "é" * 300}  # octet_length('{"a": "éé…"}'::jsonb::text) = 609
    check_json("input", value, obj=True, cap=1024)


# Text jsonb can hold: no NUL, no lone surrogates (category Cs).
clean_text = st.text(alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00"))
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | clean_text,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(clean_text, children, max_size=4)
    ),
    max_leaves=20,
)


@given(st.dictionaries(clean_text, json_values, max_size=6))
def test_clean_json_objects_pass(value: dict[str, Any]) -> None:
    check_json("input", value, obj=True)


# -- JSON: nesting (iterative, the database's limit) -------------------------------------------

from runledger.db.validate import INT32_MAX, INT32_MIN, check_int32  # noqa: E402
from runledger.model import MAX_JSON_DEPTH  # noqa: E402


def nested(depth: int, kind: str = "object") -> Any:
    """A value ``depth`` levels deep: ``{"a": {"a": 1}}`` is 2, ``[[]]`` is 2."""
    value: Any = 1 if kind == "object" else []
    for level in range(depth if kind == "object" else depth - 1):
        value = {"a": value} if kind == "object" else [value]
        del level
    return value


def test_the_limit_is_the_databases_64() -> None:
    assert MAX_JSON_DEPTH == 64


@pytest.mark.parametrize("kind", ["object", "array"])
def test_depth_up_to_the_limit_is_accepted(kind: str) -> None:
    check_json("result", nested(MAX_JSON_DEPTH, kind), obj=False)
    check_json("input", {"x": nested(MAX_JSON_DEPTH - 1, kind)}, obj=True)


@pytest.mark.parametrize("kind", ["object", "array"])
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1_000, 100_000, 1_000_000])
def test_deeper_is_invalid_input_naming_the_limit_never_recursion_error(
    kind: str, depth: int
) -> None:
    with pytest.raises(
        InvalidInput, match=f"result nests deeper than the limit of {MAX_JSON_DEPTH}"
    ):
        check_json("result", nested(depth, kind), obj=False)


def test_the_depth_check_does_not_recurse() -> None:
    import sys

    frames, frame = 0, sys._getframe()
    while frame is not None:
        frames, frame = frames + 1, frame.f_back  # type: ignore[assignment]
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(frames + 40)  # a recursive walk 65 levels deep would not fit
    try:
        with pytest.raises(InvalidInput, match="nests deeper"):
            check_json("state", nested(MAX_JSON_DEPTH + 1), obj=False)
    finally:
        sys.setrecursionlimit(old)


def test_a_value_that_contains_itself_is_refused_as_too_deep() -> None:
    loop: list[Any] = []
    loop.append(loop)
    cyclic: dict[str, Any] = {}
    cyclic["self"] = cyclic
    for value in (loop, cyclic):
        with pytest.raises(InvalidInput, match="nests deeper"):
            check_json("args", value, obj=False)


def test_a_scalar_is_depth_zero_and_an_empty_container_one() -> None:
    check_json("result", "x", obj=False, max_depth=0)
    check_json("result", [], obj=False, max_depth=1)
    check_json("input", {"a": 1}, obj=True, max_depth=1)
    for value, limit in (([], 0), ([[]], 1), ({"a": {}}, 1), ({"a": [1]}, 1)):
        with pytest.raises(InvalidInput, match=f"limit of {limit} levels"):
            check_json("result", value, obj=False, max_depth=limit)


def test_the_walk_reports_the_first_bad_string_in_document_order() -> None:
    with pytest.raises(InvalidInput, match=r"at \[1\]"):
        check_json("args", ["ok", "a\x00", "b\x00"], obj=False)


# -- int32 (priority) ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 1, -1, INT32_MIN, INT32_MAX])
def test_int32_accepts_its_range(value: int) -> None:
    assert check_int32("priority", value) == value


@pytest.mark.parametrize(
    "value",
    [
        INT32_MAX + 1,
        INT32_MIN - 1,
        2**63,
        3_000_000_000,
        10**5000,
        math.nan,
        math.inf,
        3.0,
        True,
        False,
        "3",
        None,
        b"3",
        [3],
    ],
    ids=lambda v: (
        f"{type(v).__name__}-{v!r:.20}" if not isinstance(v, int) or v < 10**20 else "huge"
    ),
)
def test_int32_refuses_the_rest_naming_the_range(value: object) -> None:
    with pytest.raises(
        InvalidInput,
        match=r"priority must be an integer from -2147483648 to "
        r"2147483647 \(int32\)",
    ) as info:
        check_int32("priority", value)
    assert len(str(info.value)) < 200
