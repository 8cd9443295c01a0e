"""The bare-SDK helpers (runledger.integrations.anthropic / .openai), offline.

Real SDK clients talk to an httpx mock transport that answers canned JSON shaped like
the real APIs and keeps every request body, so the tests check what the SDK parsed and
what it would send: the next request carries the recorded assistant turn exactly as the
API returned it, and the tool results under the provider's ids.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from anthropic.types import Message, RedactedThinkingBlock, ThinkingBlock, ToolUseBlock
from openai.types.chat import ChatCompletion, ChatCompletionMessageFunctionToolCall
from openai.types.responses import Response, ResponseFunctionToolCall, ResponseReasoningItem

from runledger.flows import (
    Decision,
    Flow,
    HistoryCall,
    HistoryTurn,
    InvalidDecision,
    PolicyContext,
    ToolCall,
)
from runledger.integrations import anthropic as rl_anthropic
from runledger.integrations import openai as rl_openai
from runledger.model import idempotency_key

# -- canned answers, shaped like the real APIs -------------------------------------------

SIGNATURE = "EqQBCkYIBxgCKkBjb2RlZCBzaWduYXR1cmUgb2YgdGhlIHRoaW5raW5nIGJsb2Nr+/=="

CLAUDE_TOOL_USE: dict[str, Any] = {
    "id": "msg_01XFDUDYJgAACzvnptvVoYEL",
    "type": "message",
    "role": "assistant",
    "model": "claude-opus-4-8",
    "content": [
        {
            "type": "thinking",
            "thinking": "The user wants the weather and the time in Paris: two tools, at once.",
            "signature": SIGNATURE,
        },
        {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT2Xlxh0L5L8rLVyIw"},
        {"type": "text", "text": "Let me check both."},
        {
            "type": "tool_use",
            "id": "toolu_01VfP3hpsjXaLS5rkKhs2DeF",
            "name": "get_weather",
            "input": {"city": "Paris", "unit": "celsius"},
        },
        {
            "type": "tool_use",
            "id": "toolu_01B7rxDT6nFdeDbqW3kqrJ8Q",
            "name": "get_time",
            "input": {"timezone": "Europe/Paris"},
        },
    ],
    "stop_reason": "tool_use",
    "stop_sequence": None,
    "usage": {
        "input_tokens": 472,
        "output_tokens": 161,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "service_tier": "standard",
        "a_field_this_sdk_does_not_know": {"kept": True},
    },
}

CLAUDE_FINAL: dict[str, Any] = {
    "id": "msg_01Aq9w938a90dw8q",
    "type": "message",
    "role": "assistant",
    "model": "claude-opus-4-8",
    "content": [
        {"type": "text", "text": "It is 21 °C in Paris; "},
        {"type": "text", "text": "I could not get the time."},
    ],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {"input_tokens": 700, "output_tokens": 20},
}

CHAT_TOOL_CALLS: dict[str, Any] = {
    "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
    "object": "chat.completion",
    "created": 1741569952,
    "model": "gpt-5.5-2026-04-23",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "annotations": [],
                "tool_calls": [
                    {
                        "id": "call_Wq8B1x2Cv3",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": '{"city": "Paris", "unit": "celsius"}',
                        },
                    },
                    {
                        "id": "call_Zk4mN7pQ9r",
                        "type": "function",
                        "function": {
                            "name": "get_time",
                            "arguments": '{"timezone":"Europe/Paris"}',
                        },
                    },
                ],
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {
        "prompt_tokens": 82,
        "completion_tokens": 41,
        "total_tokens": 123,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
    },
    "service_tier": "default",
    "system_fingerprint": "fp_50cad350e4",
}

CHAT_FINAL: dict[str, Any] = {
    "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcU",
    "object": "chat.completion",
    "created": 1741569953,
    "model": "gpt-5.5-2026-04-23",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "It is 21 °C in Paris.",
                "refusal": None,
                "annotations": [],
            },
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 150, "completion_tokens": 9, "total_tokens": 159},
}

REASONING_ITEM: dict[str, Any] = {
    "id": "rs_68af4030baa48193b0b43b4c2a176a1a02d7b186",
    "type": "reasoning",
    "summary": [{"type": "summary_text", "text": "Two lookups are needed."}],
    "encrypted_content": "gAAAAABor0BCx2y3Pw-opaque-encrypted-reasoning-kept-as-is==",
}

RESPONSE_CALLS: dict[str, Any] = {
    "id": "resp_68af4030592c81938ec0a5fbab4a3e9f",
    "object": "response",
    "created_at": 1756315696,
    "status": "completed",
    "error": None,
    "incomplete_details": None,
    "instructions": "You are a weather assistant. " * 20,
    "model": "gpt-5.5-2026-04-23",
    "output": [
        REASONING_ITEM,
        {
            "id": "fc_68af4034e3ec8193a35bdd5d1c2a0f4c",
            "type": "function_call",
            "status": "completed",
            "arguments": '{"city":"Paris","unit":"celsius"}',
            "call_id": "call_q1PD4iGPxXnV",
            "name": "get_weather",
        },
        {
            "id": "fc_68af4034e3ec8193a35bdd5d1c2a0f4d",
            "type": "function_call",
            "status": "completed",
            "arguments": '{"timezone":"Europe/Paris"}',
            "call_id": "call_r2QE5jHQyYoW",
            "name": "get_time",
        },
    ],
    "parallel_tool_calls": True,
    "temperature": 1.0,
    "tool_choice": "auto",
    "tools": [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            "strict": False,
        }
    ],
    "top_p": 1.0,
    "usage": {
        "input_tokens": 320,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 210,
        "output_tokens_details": {"reasoning_tokens": 128},
        "total_tokens": 530,
    },
}

RESPONSE_FINAL: dict[str, Any] = {
    "id": "resp_68af40a1b2c3",
    "object": "response",
    "created_at": 1756315700,
    "status": "completed",
    "model": "gpt-5.5-2026-04-23",
    "output": [
        {
            "id": "msg_68af40a1d4e5",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [
                {"type": "output_text", "text": "It is 21 °C in Paris.", "annotations": []}
            ],
        }
    ],
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "usage": {
        "input_tokens": 600,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 12,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 612,
    },
}


# -- the fake API --------------------------------------------------------------------


@dataclass
class FakeApi:
    """Answers each request with the next canned body; keeps every request."""

    answers: list[dict[str, Any]]
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append((request.url.path, json.loads(request.content)))
        return httpx2.Response(200, json=self.answers.pop(0))

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [body for _, body in self.requests]


def claude(api: FakeApi) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        api_key="test",
        base_url="http://anthropic.test",
        http_client=httpx2.Client(transport=httpx2.MockTransport(api)),
        max_retries=0,
    )


def gpt(api: FakeApi) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="test",
        base_url="http://openai.test/v1",
        http_client=httpx2.Client(transport=httpx2.MockTransport(api)),
        max_retries=0,
    )


def weather_flow() -> Flow:
    flow = Flow("weather", "1")

    @flow.tool(safety="read_only")
    def get_weather(ctx: Any, city: str, unit: str = "celsius") -> dict[str, Any]:
        return {"temp": 21, "unit": unit}

    @flow.tool(safety="read_only")
    def get_time(ctx: Any, timezone: str) -> str:
        return "12:00"

    return flow


def ctx(run_id: str = "run-1", turn: int = 0) -> PolicyContext:
    return PolicyContext(run_id=run_id, flow="weather@1", input={"q": "Paris?"}, turn=turn)


def stored(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a record looks like after a trip through jsonb: same JSON, keys reordered."""
    return None if record is None else json.loads(json.dumps(record, sort_keys=True))


def executed(flow: Flow, decision: Decision, turn: int, outcomes: Sequence[Any]) -> HistoryTurn:
    """The turn as the executor hands it back: call ids assigned by runledger
    (``flow.normalize``), each call's provider id and outcome, the stored record.
    ``outcomes``: ``("succeeded", result)`` or ``("failed", error)`` per call."""
    payload = flow.normalize(decision.calls).calls
    assert len(payload) == len(outcomes)
    calls = tuple(
        HistoryCall(
            call_id=row["call_id"],
            tool=row["tool"],
            args=row["args"],
            status=status,
            result=value if status == "succeeded" else None,
            error=None if status == "succeeded" else value,
            provider_id=call.provider_id,
        )
        for row, call, (status, value) in zip(payload, decision.calls, outcomes, strict=True)
    )
    return HistoryTurn(turn=turn, calls=calls, record=stored(decision.record))


TIMEOUT = {"type": "TimeoutError", "message": "time service did not answer"}

# -- Anthropic Messages ----------------------------------------------------------------


def test_anthropic_decision_from_the_sdk_message() -> None:
    api = FakeApi([copy.deepcopy(CLAUDE_TOOL_USE)])
    message = claude(api).messages.create(
        model="claude-opus-4-8", max_tokens=2048, messages=[{"role": "user", "content": "hi"}]
    )
    assert isinstance(message, Message)
    assert [type(b) for b in message.content[:2]] == [ThinkingBlock, RedactedThinkingBlock]
    assert isinstance(message.content[3], ToolUseBlock)

    decision = rl_anthropic.decision_from_message(message)

    assert decision.calls == (
        ToolCall(
            "get_weather",
            {"city": "Paris", "unit": "celsius"},
            provider_id="toolu_01VfP3hpsjXaLS5rkKhs2DeF",
        ),
        ToolCall(
            "get_time", {"timezone": "Europe/Paris"}, provider_id="toolu_01B7rxDT6nFdeDbqW3kqrJ8Q"
        ),
    )
    assert all(call.call_id is None for call in decision.calls)  # runledger numbers them
    assert decision.record == CLAUDE_TOOL_USE  # verbatim, unknown usage field included
    assert decision.output is None
    # the JSON itself gives the same decision
    assert rl_anthropic.decision_from_message(copy.deepcopy(CLAUDE_TOOL_USE)) == decision
    # the args are the tool's own copy: changing them does not change the record
    decision.calls[0].args["city"] = "Lyon"
    assert decision.record["content"][3]["input"]["city"] == "Paris"


def test_anthropic_final_text_is_the_output() -> None:
    decision = rl_anthropic.decision_from_message(copy.deepcopy(CLAUDE_FINAL))
    assert decision.calls == ()
    assert decision.output == "It is 21 °C in Paris; I could not get the time."
    assert decision.record == CLAUDE_FINAL


def test_anthropic_message_round_trip_through_the_policy() -> None:
    api = FakeApi([copy.deepcopy(CLAUDE_TOOL_USE), copy.deepcopy(CLAUDE_FINAL)])
    tools = [
        {"name": "get_weather", "input_schema": {"type": "object"}},
        {"name": "get_time", "input_schema": {"type": "object"}},
    ]
    policy = rl_anthropic.anthropic_policy(
        claude(api),
        model="claude-opus-4-8",
        max_tokens=2048,
        tools=tools,
        system="You are terse.",
        prompt=lambda c: f"Weather and time in {c.input['q']}",
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    flow = weather_flow()

    first = policy(ctx(), [])
    turn0 = executed(flow, first, 0, [("succeeded", {"temp": 21}), ("failed", TIMEOUT)])
    assert [c.call_id for c in turn0.calls] == ["c0", "c1"]
    final = policy(ctx(turn=1), [turn0])

    assert [path for path, _ in api.requests] == ["/v1/messages", "/v1/messages"]
    body0, body1 = api.bodies
    assert body0["messages"] == [{"role": "user", "content": "Weather and time in Paris?"}]
    assert body0["system"] == "You are terse."
    assert body0["tools"] == tools
    assert body0["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    user, assistant, results = body1["messages"]
    assert user == body0["messages"][0]
    # the assistant message exactly as the API returned it: thinking signature intact
    assert assistant == {"role": "assistant", "content": CLAUDE_TOOL_USE["content"]}
    assert assistant["content"][0]["signature"] == SIGNATURE
    assert results == {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_01VfP3hpsjXaLS5rkKhs2DeF",
                "content": '{"temp": 21}',
            },
            {
                "type": "tool_result",
                "tool_use_id": "toolu_01B7rxDT6nFdeDbqW3kqrJ8Q",
                "content": json.dumps(TIMEOUT),
                "is_error": True,
            },
        ],
    }
    assert final.calls == ()
    assert final.output == "It is 21 °C in Paris; I could not get the time."


def test_anthropic_results_follow_the_record_not_the_call_order() -> None:
    decision = rl_anthropic.decision_from_message(copy.deepcopy(CLAUDE_TOOL_USE))
    turn = executed(
        weather_flow(), decision, 0, [("succeeded", {"temp": 21}), ("succeeded", "12:00")]
    )
    shuffled = HistoryTurn(turn=0, calls=tuple(reversed(turn.calls)), record=turn.record)
    messages = rl_anthropic.messages_from_history("q", [shuffled])
    assert [(b["tool_use_id"], b["content"]) for b in messages[2]["content"]] == [
        ("toolu_01VfP3hpsjXaLS5rkKhs2DeF", '{"temp": 21}'),
        ("toolu_01B7rxDT6nFdeDbqW3kqrJ8Q", "12:00"),  # a string result is sent as it is
    ]


def test_anthropic_other_outcomes_and_given_messages() -> None:
    decision = rl_anthropic.decision_from_message(copy.deepcopy(CLAUDE_TOOL_USE))
    turn = executed(weather_flow(), decision, 0, [("succeeded", None), ("succeeded", None)])
    denied = HistoryCall(**{**_fields(turn.calls[1]), "status": "denied", "error": "no"})
    turn = HistoryTurn(turn=0, calls=(turn.calls[0], denied), record=turn.record)
    given = [{"role": "user", "content": [{"type": "text", "text": "q"}]}]
    messages = rl_anthropic.messages_from_history(given, [turn])
    assert messages[0] == given[0] and messages[0] is not given[0]
    assert messages[2]["content"][1] == {
        "type": "tool_result",
        "tool_use_id": "toolu_01B7rxDT6nFdeDbqW3kqrJ8Q",
        "content": json.dumps({"status": "denied", "error": "no"}),
        "is_error": True,
    }
    # the messages are a copy: editing them leaves the history alone
    messages[1]["content"][0]["signature"] = "edited"
    assert turn.record is not None and turn.record["content"][0]["signature"] == SIGNATURE


def _fields(call: HistoryCall) -> dict[str, Any]:
    return {name: getattr(call, name) for name in HistoryCall.__dataclass_fields__}


# ``runledger resolve KEY abandoned --note ...``: the call's error as resolve_call writes it
ABANDONED = {"reason": "abandoned", "note": "called the customer"}
GIVEN_UP = (
    "This tool call was given up by an operator: it may or may not have taken effect, "
    "so do not repeat it. The operator's note: called the customer"
)


def test_anthropic_an_abandoned_call_is_shown_as_given_up_with_the_note() -> None:
    """It may have taken effect: the model is told not to repeat it, not just handed an
    error it would read as "it failed, try again"."""
    decision = rl_anthropic.decision_from_message(copy.deepcopy(CLAUDE_TOOL_USE))
    turn = executed(weather_flow(), decision, 0, [("succeeded", 1), ("failed", ABANDONED)])
    [_, _, results] = rl_anthropic.messages_from_history("q", [turn])
    assert results["content"][1] == {
        "type": "tool_result",
        "tool_use_id": "toolu_01B7rxDT6nFdeDbqW3kqrJ8Q",
        "content": GIVEN_UP,
        "is_error": True,
    }
    # a tool's own NotApplied("abandoned") is an ordinary failure: its error as it is
    own = {"reason": "abandoned", "not_applied": True}
    turn = executed(weather_flow(), decision, 0, [("succeeded", 1), ("failed", own)])
    [_, _, results] = rl_anthropic.messages_from_history("q", [turn])
    assert results["content"][1]["content"] == json.dumps(own)


def test_openai_an_abandoned_call_is_shown_as_given_up_with_the_note() -> None:
    chat = rl_openai.decision_from_chat_completion(copy.deepcopy(CHAT_TOOL_CALLS))
    turn = executed(weather_flow(), chat, 0, [("succeeded", 1), ("failed", ABANDONED)])
    messages = rl_openai.messages_from_history("q", [turn])
    assert messages[-1] == {
        "role": "tool",
        "tool_call_id": "call_Zk4mN7pQ9r",
        "content": json.dumps({"error": GIVEN_UP}),
    }
    response = rl_openai.decision_from_response(copy.deepcopy(RESPONSE_CALLS))
    turn = executed(weather_flow(), response, 0, [("failed", ABANDONED), ("succeeded", 2)])
    items = rl_openai.input_from_history("q", [turn])
    assert items[-2] == {
        "type": "function_call_output",
        "call_id": "call_q1PD4iGPxXnV",
        "output": json.dumps({"error": GIVEN_UP}),
    }


def test_anthropic_unusable_histories_are_refused() -> None:
    decision = rl_anthropic.decision_from_message(copy.deepcopy(CLAUDE_TOOL_USE))
    turn = executed(weather_flow(), decision, 0, [("succeeded", 1), ("succeeded", 2)])
    no_record = HistoryTurn(turn=0, calls=turn.calls, record=None)
    with pytest.raises(rl_anthropic.UnusableHistory, match="turn 0 has no record"):
        rl_anthropic.messages_from_history("q", [no_record])
    one_call = HistoryTurn(turn=0, calls=turn.calls[:1], record=turn.record)
    with pytest.raises(rl_anthropic.UnusableHistory, match="toolu_01B7rxDT6nFdeDbqW3kqrJ8Q"):
        rl_anthropic.messages_from_history("q", [one_call])
    stranger = HistoryCall(**{**_fields(turn.calls[0]), "call_id": "c9", "provider_id": "toolu_x"})
    extra = HistoryTurn(turn=0, calls=(*turn.calls, stranger), record=turn.record)
    with pytest.raises(rl_anthropic.UnusableHistory, match=r"\['c9'\]"):
        rl_anthropic.messages_from_history("q", [extra])
    chat = HistoryTurn(turn=0, calls=(), record=copy.deepcopy(CHAT_TOOL_CALLS))
    with pytest.raises(rl_anthropic.UnusableHistory, match="not an Anthropic message"):
        rl_anthropic.messages_from_history("q", [chat])
    with pytest.raises(TypeError, match="assistant message"):
        rl_anthropic.decision_from_message(copy.deepcopy(CHAT_TOOL_CALLS))


def test_provider_ids_never_become_call_ids_or_keys() -> None:
    """Two runs (and two turns of one run) whose model repeats the same tool_use ids."""
    flow = weather_flow()
    keys = []
    for run_id, turn in (("run-a", 0), ("run-b", 0), ("run-a", 1)):
        decision = rl_anthropic.decision_from_message(copy.deepcopy(CLAUDE_TOOL_USE))
        payload = flow.normalize(decision.calls).calls
        assert [row["call_id"] for row in payload] == ["c0", "c1"]
        keys += [idempotency_key(run_id, turn, row["call_id"]) for row in payload]
    assert len(set(keys)) == len(keys) == 6
    assert not any("toolu" in key for key in keys)


async def test_anthropic_policy_is_async_with_an_async_client() -> None:
    api = FakeApi([copy.deepcopy(CLAUDE_FINAL)])
    client = anthropic.AsyncAnthropic(
        api_key="test",
        base_url="http://anthropic.test",
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(api)),
        max_retries=0,
    )
    policy = rl_anthropic.anthropic_policy(client, model="claude-opus-4-8", prompt=lambda c: "q")
    assert inspect.iscoroutinefunction(policy)  # the executor awaits it: cancellable
    decision = await policy(ctx(), [])
    assert (
        decision.output == CLAUDE_FINAL["content"][0]["text"] + CLAUDE_FINAL["content"][1]["text"]
    )
    assert api.bodies[0]["max_tokens"] == 4096


def test_policy_helpers_refuse_what_they_build_and_warn_about_sdk_retries(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = FakeApi([])
    with pytest.raises(ValueError, match="messages"):
        rl_anthropic.anthropic_policy(claude(api), model="m", prompt=str, messages=[])
    with pytest.raises(ValueError, match="previous_response_id"):
        rl_openai.openai_responses_policy(gpt(api), model="m", prompt=str, previous_response_id="r")
    with pytest.raises(ValueError, match="stream"):
        rl_openai.openai_chat_policy(gpt(api), model="m", prompt=str, stream=True)
    retrying = anthropic.Anthropic(api_key="test", base_url="http://anthropic.test")
    with caplog.at_level(logging.WARNING):
        rl_anthropic.anthropic_policy(retrying, model="m", prompt=str)
        rl_anthropic.anthropic_policy(claude(api), model="m", prompt=str)
    assert [r.getMessage() for r in caplog.records if "max_retries=0" in r.getMessage()] == [
        "anthropic_policy: the client retries 2 times itself; runledger retries the policy: "
        "build it with max_retries=0"
    ]


# -- OpenAI Chat Completions -------------------------------------------------------------


def test_chat_decision_from_the_sdk_completion() -> None:
    api = FakeApi([copy.deepcopy(CHAT_TOOL_CALLS)])
    completion = gpt(api).chat.completions.create(
        model="gpt-5.5", messages=[{"role": "user", "content": "hi"}]
    )
    assert isinstance(completion, ChatCompletion)
    tool_calls = completion.choices[0].message.tool_calls or []
    assert all(isinstance(t, ChatCompletionMessageFunctionToolCall) for t in tool_calls)

    decision = rl_openai.decision_from_chat_completion(completion)

    assert decision.calls == (
        ToolCall(
            "get_weather", {"city": "Paris", "unit": "celsius"}, provider_id="call_Wq8B1x2Cv3"
        ),
        ToolCall("get_time", {"timezone": "Europe/Paris"}, provider_id="call_Zk4mN7pQ9r"),
    )
    assert decision.record == CHAT_TOOL_CALLS
    assert decision.output is None
    final = rl_openai.decision_from_chat_completion(copy.deepcopy(CHAT_FINAL))
    assert (final.calls, final.output) == ((), "It is 21 °C in Paris.")


def test_chat_round_trip_through_the_policy() -> None:
    api = FakeApi([copy.deepcopy(CHAT_TOOL_CALLS), copy.deepcopy(CHAT_FINAL)])
    system = {"role": "developer", "content": "Be terse."}
    policy = rl_openai.openai_chat_policy(
        gpt(api),
        model="gpt-5.5",
        tools=[{"type": "function", "function": {"name": "get_weather"}}],
        prompt=lambda c: [system, {"role": "user", "content": c.input["q"]}],
        parallel_tool_calls=True,
    )
    first = policy(ctx(), [])
    turn0 = executed(weather_flow(), first, 0, [("succeeded", {"temp": 21}), ("failed", TIMEOUT)])
    final = policy(ctx(turn=1), [turn0])

    assert [path for path, _ in api.requests] == ["/v1/chat/completions"] * 2
    body0, body1 = api.bodies
    assert body0["parallel_tool_calls"] is True
    assert body1["messages"] == [
        system,
        {"role": "user", "content": "Paris?"},
        CHAT_TOOL_CALLS["choices"][0]["message"],  # exactly as the API returned it
        {"role": "tool", "tool_call_id": "call_Wq8B1x2Cv3", "content": '{"temp": 21}'},
        {
            "role": "tool",
            "tool_call_id": "call_Zk4mN7pQ9r",
            "content": json.dumps({"error": TIMEOUT}),
        },
    ]
    assert final.output == "It is 21 °C in Paris."


def test_chat_uses_and_keeps_only_the_first_choice() -> None:
    two = copy.deepcopy(CHAT_TOOL_CALLS)
    other = copy.deepcopy(CHAT_FINAL["choices"][0])
    two["choices"].append({**other, "index": 1})
    decision = rl_openai.decision_from_chat_completion(two)
    assert decision.record == CHAT_TOOL_CALLS
    assert [call.provider_id for call in decision.calls] == ["call_Wq8B1x2Cv3", "call_Zk4mN7pQ9r"]


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        pytest.param('{"city": "Par', "Unterminated string", id="truncated"),
        pytest.param('["Paris"]', "a JSON list", id="not-an-object"),
    ],
)
def test_chat_invalid_arguments_are_a_typed_invalid_decision(arguments: str, reason: str) -> None:
    completion = copy.deepcopy(CHAT_TOOL_CALLS)
    completion["choices"][0]["message"]["tool_calls"][1]["function"]["arguments"] = arguments
    with pytest.raises(rl_openai.InvalidToolArguments, match=reason) as caught:
        rl_openai.decision_from_chat_completion(completion)
    assert isinstance(caught.value, InvalidDecision)  # the run fails as invalid_decision
    assert (caught.value.tool, caught.value.provider_id) == ("get_time", "call_Zk4mN7pQ9r")
    assert caught.value.arguments == arguments


def test_chat_empty_arguments_and_unsupported_calls() -> None:
    completion = copy.deepcopy(CHAT_TOOL_CALLS)
    completion["choices"][0]["message"]["tool_calls"][1]["function"]["arguments"] = ""
    assert rl_openai.decision_from_chat_completion(completion).calls[1].args == {}
    custom = copy.deepcopy(CHAT_TOOL_CALLS)
    custom["choices"][0]["message"]["tool_calls"][0] = {
        "id": "call_c",
        "type": "custom",
        "custom": {"name": "grep", "input": "x"},
    }
    with pytest.raises(rl_openai.UnsupportedToolCall, match="'custom'"):
        rl_openai.decision_from_chat_completion(custom)
    with pytest.raises(rl_openai.UnusableHistory, match="not a chat completion"):
        rl_openai.messages_from_history(
            "q", [HistoryTurn(turn=0, calls=(), record=copy.deepcopy(CLAUDE_FINAL))]
        )


# -- OpenAI Responses ------------------------------------------------------------------


def test_responses_decision_from_the_sdk_response() -> None:
    api = FakeApi([copy.deepcopy(RESPONSE_CALLS)])
    response = gpt(api).responses.create(model="gpt-5.5", input="hi")
    assert isinstance(response, Response)
    assert isinstance(response.output[0], ResponseReasoningItem)
    assert isinstance(response.output[1], ResponseFunctionToolCall)

    decision = rl_openai.decision_from_response(response)

    assert decision.calls == (
        ToolCall(
            "get_weather", {"city": "Paris", "unit": "celsius"}, provider_id="call_q1PD4iGPxXnV"
        ),
        ToolCall("get_time", {"timezone": "Europe/Paris"}, provider_id="call_r2QE5jHQyYoW"),
    )
    assert decision.record is not None
    assert decision.record["output"] == RESPONSE_CALLS["output"]  # reasoning item verbatim
    assert decision.record["usage"] == RESPONSE_CALLS["usage"]
    assert {"id", "model", "status"} <= decision.record.keys()
    assert not {"instructions", "tools"} & decision.record.keys()  # the request's echo
    assert decision.output is None


def test_responses_round_trip_through_the_policy() -> None:
    api = FakeApi([copy.deepcopy(RESPONSE_CALLS), copy.deepcopy(RESPONSE_FINAL)])
    policy = rl_openai.openai_responses_policy(
        gpt(api),
        model="gpt-5.5",
        instructions="You are a weather assistant.",
        prompt=lambda c: c.input["q"],
        store=False,
        include=["reasoning.encrypted_content"],
    )
    first = policy(ctx(), [])
    turn0 = executed(weather_flow(), first, 0, [("failed", TIMEOUT), ("succeeded", "12:00")])
    final = policy(ctx(turn=1), [turn0])

    assert [path for path, _ in api.requests] == ["/v1/responses"] * 2
    body0, body1 = api.bodies
    assert body0["input"] == [{"role": "user", "content": "Paris?"}]
    assert body0["store"] is False and body0["include"] == ["reasoning.encrypted_content"]
    assert body1["instructions"] == "You are a weather assistant."
    assert "previous_response_id" not in body1
    assert body1["input"] == [
        {"role": "user", "content": "Paris?"},
        *RESPONSE_CALLS["output"],  # re-sent as they were: encrypted reasoning included
        {
            "type": "function_call_output",
            "call_id": "call_q1PD4iGPxXnV",
            "output": json.dumps({"error": TIMEOUT}),
        },
        {"type": "function_call_output", "call_id": "call_r2QE5jHQyYoW", "output": "12:00"},
    ]
    assert body1["input"][1]["encrypted_content"] == REASONING_ITEM["encrypted_content"]
    assert final.calls == ()
    assert final.output == "It is 21 °C in Paris."


async def test_openai_policies_are_async_with_an_async_client() -> None:
    api = FakeApi([copy.deepcopy(RESPONSE_FINAL), copy.deepcopy(CHAT_FINAL)])
    client = openai.AsyncOpenAI(
        api_key="test",
        base_url="http://openai.test/v1",
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(api)),
        max_retries=0,
    )
    responses = rl_openai.openai_responses_policy(client, model="gpt-5.5", prompt=lambda c: "q")
    chat = rl_openai.openai_chat_policy(client, model="gpt-5.5", prompt=lambda c: "q")
    assert inspect.iscoroutinefunction(responses) and inspect.iscoroutinefunction(chat)
    assert (await responses(ctx(), [])).output == "It is 21 °C in Paris."
    assert (await chat(ctx(), [])).output == "It is 21 °C in Paris."
    assert [path for path, _ in api.requests] == ["/v1/responses", "/v1/chat/completions"]


def test_responses_invalid_arguments_and_client_side_items() -> None:
    broken = copy.deepcopy(RESPONSE_CALLS)
    broken["output"][1]["arguments"] = "{city: Paris}"
    with pytest.raises(rl_openai.InvalidToolArguments, match="call_q1PD4iGPxXnV"):
        rl_openai.decision_from_response(broken)
    shell = copy.deepcopy(RESPONSE_CALLS)
    shell["output"].append({"type": "local_shell_call", "id": "lsh_1", "call_id": "call_s"})
    with pytest.raises(rl_openai.UnsupportedToolCall, match="local_shell_call"):
        rl_openai.decision_from_response(shell)
    decision = rl_openai.decision_from_response(copy.deepcopy(RESPONSE_CALLS))
    turn = executed(weather_flow(), decision, 0, [("succeeded", 1), ("succeeded", 2)])
    with pytest.raises(rl_openai.UnusableHistory, match="call_r2QE5jHQyYoW"):
        rl_openai.input_from_history(
            "q", [HistoryTurn(turn=0, calls=turn.calls[:1], record=turn.record)]
        )


# -- packaging -------------------------------------------------------------------------


def test_runledger_imports_without_the_sdks_and_the_helpers_name_the_extra() -> None:
    """The SDKs are imported only by their helper module, which names the extra."""
    script = """
import sys

class NoSdks:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("anthropic", "openai"):
            raise ImportError(f"No module named {name!r} (blocked)")
        return None

sys.meta_path.insert(0, NoSdks())
import runledger, runledger.flows, runledger.worker, runledger.cli, runledger.integrations
for helper, extra in (("anthropic", "anthropic"), ("openai", "openai")):
    try:
        __import__(f"runledger.integrations.{helper}")
    except ImportError as exc:
        assert f"runledger-pg[{extra}]" in str(exc), exc
    else:
        raise AssertionError(f"runledger.integrations.{helper} imported without its SDK")
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
