"""Flow.normalize: a Decision or a bare list of ToolCall becomes what record_turn_v2
records; call ids are runledger's, provider ids are kept beside them."""

from __future__ import annotations

from typing import Any

import pytest

from runledger.flows import Decision, Flow, InvalidDecision, Recordable, ToolCall


def flow() -> Flow:
    f = Flow("norm", "1")

    @f.tool(safety="idempotent")
    def create_ticket(ctx: Any, title: str = "t") -> None: ...

    return f


def test_a_bare_list_has_no_record_and_no_output() -> None:
    got = flow().normalize([ToolCall("create_ticket", {"title": "a"}), ToolCall("create_ticket")])
    assert got == Recordable(
        calls=[
            {"call_id": "c0", "tool": "create_ticket", "args": {"title": "a"}},
            {"call_id": "c1", "tool": "create_ticket", "args": {}},
        ]
    )


def test_a_decision_keeps_its_record_and_provider_ids_but_not_as_call_ids() -> None:
    record = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1"}]}
    got = flow().normalize(
        Decision(
            calls=[
                ToolCall("create_ticket", provider_id="toolu_1"),
                ToolCall("create_ticket", provider_id="not a call id: ñ/?"),
                ToolCall("create_ticket", call_id="mine", provider_id="toolu_3"),
            ],
            record=record,
        )
    )
    assert [(c["call_id"], c["provider_id"]) for c in got.calls] == [
        ("c0", "toolu_1"),
        ("c1", "not a call id: ñ/?"),
        ("mine", "toolu_3"),
    ]
    assert got.record is record and got.output is None


def test_a_final_decision_carries_its_output() -> None:
    got = flow().normalize(Decision(record={"a": 1}, output=["done", {"n": 1}]))
    assert got == Recordable(calls=[], record={"a": 1}, output=["done", {"n": 1}])


@pytest.mark.parametrize(
    ("decision", "message"),
    [
        (Decision(calls=[ToolCall("create_ticket")], output="early"), "has no output"),
        (Decision(record=[1, 2]), "record must be a dict"),  # type: ignore[arg-type]
        (Decision(record={"x": {1, 2}}), "record is not JSON"),
        (Decision(record={"x": "a\x00b"}), "record contains a NUL"),
        (Decision(output=float("nan")), "output is not JSON"),
        (Decision(calls=[ToolCall("create_ticket", provider_id="")]), "provider id"),
        (Decision(calls=[ToolCall("create_ticket", provider_id="p" * 201)]), "provider id"),
        (Decision(calls=[ToolCall("create_ticket", provider_id=7)]), "provider id"),  # type: ignore[arg-type]
        (Decision(calls=[ToolCall("nope")]), "unknown tool"),
        ("not a decision", "a Decision or a list of ToolCall"),
    ],
)
def test_a_bad_decision_is_an_invalid_decision(decision: Any, message: str) -> None:
    with pytest.raises(InvalidDecision, match=message):
        flow().normalize(decision)


def test_a_provider_id_of_200_characters_is_kept() -> None:
    got = flow().normalize(Decision(calls=[ToolCall("create_ticket", provider_id="p" * 200)]))
    assert got.calls[0]["provider_id"] == "p" * 200
