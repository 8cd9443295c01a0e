"""The safety class an MCP tool gets from its annotations when the flow names none: the
table of runledger.integrations._mcp, without a server (tests/integration/test_mcp_tools.py
lists them from a real one)."""

from __future__ import annotations

from typing import Any

import pytest
from mcp_types import ToolAnnotations

from runledger.integrations._mcp import (
    McpToolsUnavailable,
    annotations_of,
    hinted_safety,
    resolve_safety,
    run_aside,
)
from runledger.model import Safety

R, IDEM, U = Safety.READ_ONLY, Safety.IDEMPOTENT, Safety.UNSAFE

# (annotations, class by default, class with trust_mcp_hints=True)
TABLE: list[tuple[dict[str, Any] | None, Safety, Safety]] = [
    (None, U, U),
    ({}, U, U),
    ({"readOnlyHint": True}, R, R),
    ({"readOnlyHint": True, "destructiveHint": True}, R, R),  # meaningless when read-only
    ({"readOnlyHint": False}, U, U),
    ({"idempotentHint": True}, U, U),  # destructiveHint defaults to true
    ({"idempotentHint": True, "destructiveHint": True}, U, U),
    ({"idempotentHint": True, "destructiveHint": False}, U, IDEM),
    ({"idempotentHint": True, "destructiveHint": False, "openWorldHint": True}, U, IDEM),
    ({"destructiveHint": False}, U, U),
    ({"idempotentHint": False, "destructiveHint": False}, U, U),
    # only exactly true or false is a hint
    ({"readOnlyHint": "true"}, U, U),
    ({"readOnlyHint": 1}, U, U),
    ({"idempotentHint": True, "destructiveHint": 0}, U, U),
]


@pytest.mark.parametrize(("annotations", "default", "trusted"), TABLE)
def test_the_class_of_each_combination_of_hints(
    annotations: dict[str, Any] | None, default: Safety, trusted: Safety
) -> None:
    assert hinted_safety(annotations) is default
    assert hinted_safety(annotations, trust=True) is trusted


def test_the_mcp_packages_annotations_read_as_the_wire_spells_them() -> None:
    hints = annotations_of(ToolAnnotations(idempotent_hint=True, destructive_hint=False))
    assert hints is not None
    assert (hints["idempotentHint"], hints["destructiveHint"]) == (True, False)
    assert hinted_safety(hints, trust=True) is IDEM
    assert annotations_of(None) is None
    with pytest.raises(TypeError, match="must be a mapping, got int"):
        annotations_of(3)


MCP = {"read": {"readOnlyHint": True}, "set": {"idempotentHint": True, "destructiveHint": False}}


def test_an_explicit_class_always_wins() -> None:
    got = resolve_safety(
        ["fn"],
        {**MCP, "bare": None},
        {"fn": "lookup", "read": "unsafe", "bare": "idempotent"},
        trust_mcp_hints=True,
    )
    assert got == {"fn": "lookup", "read": "unsafe", "set": IDEM, "bare": "idempotent"}


def test_mcp_tools_default_and_function_tools_still_need_a_class() -> None:
    assert resolve_safety([], MCP, {}, trust_mcp_hints=False) == {"read": R, "set": U}
    with pytest.raises(ValueError, match="agent tools without a safety class: fn"):
        resolve_safety(["fn"], MCP, {"read": "unsafe"}, trust_mcp_hints=False)
    with pytest.raises(ValueError, match="safety names tools the agent does not have: nope"):
        resolve_safety([], MCP, {"nope": "unsafe"}, trust_mcp_hints=False)
    with pytest.raises(ValueError, match="has the name of a function tool: read"):
        resolve_safety(["read"], MCP, {"read": "unsafe"}, trust_mcp_hints=False)


def test_trust_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="trust_mcp_hints must be True or False, got 'yes'"):
        resolve_safety([], MCP, {}, trust_mcp_hints="yes")  # type: ignore[arg-type]


def test_a_listing_that_fails_is_one_line_naming_the_server() -> None:
    async def fails() -> None:
        raise ExceptionGroup("task group", [OSError("No such file or directory: 'nope'")])

    with pytest.raises(McpToolsUnavailable) as caught:
        run_aside("MCP server nope: tools not listed", fails)
    assert str(caught.value) == (
        "MCP server nope: tools not listed: OSError: No such file or directory: 'nope'"
    )
