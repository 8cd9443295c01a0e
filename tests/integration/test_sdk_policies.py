"""The bare-SDK policies (Anthropic Messages, OpenAI Chat Completions and Responses)
driven by a real worker against a real database. The SDK clients are real and talk to
an httpx mock transport that answers like the API (the canned bodies of
``tests/unit/test_sdk_helpers.py``) and keeps every request.

For each SDK, two runs whose model answers with the same provider tool-call ids:
one decision row per turn holding the answer verbatim, one model request per turn,
runledger's own keys (distinct across the runs), each tool once per key, and the second
request carrying the recorded assistant turn and the results under the provider's ids.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from runledger.flows import Flow
from runledger.integrations import anthropic as rl_anthropic
from runledger.integrations import openai as rl_openai
from tests.integration.conftest import Db, StartWorker
from tests.unit.test_sdk_helpers import (
    CHAT_FINAL,
    CHAT_TOOL_CALLS,
    CLAUDE_FINAL,
    CLAUDE_TOOL_USE,
    RESPONSE_CALLS,
    RESPONSE_FINAL,
)

RUNS = ("sdk-a", "sdk-b")


class Api:
    """Answers a request with the tool calls until it carries tool results, then with
    the final answer; keeps every request body (the worker may call from a thread)."""

    def __init__(
        self, first: dict[str, Any], final: dict[str, Any], answered: Callable[[Any], bool]
    ):
        self.first, self.final, self.answered = first, final, answered
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        with self.lock:
            self.bodies.append(body)
        answer = self.final if self.answered(body) else self.first
        return httpx2.Response(200, json=copy.deepcopy(answer))


def weather(name: str, policy: Callable[..., Any], seen: list[str]) -> Flow:
    flow = Flow(name, "1")

    @flow.tool(safety="read_only")
    def get_weather(ctx: Any, city: str, unit: str = "celsius") -> dict[str, Any]:
        seen.append(ctx.idempotency_key)
        return {"temp": 21, "unit": unit}

    @flow.tool(safety="read_only")
    def get_time(ctx: Any, timezone: str) -> str:
        seen.append(ctx.idempotency_key)
        return "12:00"

    flow.policy(policy)
    return flow


def prompt(ctx: Any) -> str:
    return "Weather and time in Paris?"


def anthropic_case() -> tuple[Api, Callable[..., Any]]:
    api = Api(
        CLAUDE_TOOL_USE,
        CLAUDE_FINAL,
        lambda body: (
            isinstance(body["messages"][-1]["content"], list)
            and body["messages"][-1]["content"][0].get("type") == "tool_result"
        ),
    )
    client = anthropic.AsyncAnthropic(
        api_key="test",
        base_url="http://anthropic.test",
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(api)),
        max_retries=0,
    )
    return api, rl_anthropic.anthropic_policy(client, model="claude-opus-4-8", prompt=prompt)


def chat_case() -> tuple[Api, Callable[..., Any]]:
    api = Api(CHAT_TOOL_CALLS, CHAT_FINAL, lambda body: body["messages"][-1]["role"] == "tool")
    client = openai.OpenAI(  # the sync client: the policy runs in a thread
        api_key="test",
        base_url="http://openai.test/v1",
        http_client=httpx2.Client(transport=httpx2.MockTransport(api)),
        max_retries=0,
    )
    return api, rl_openai.openai_chat_policy(client, model="gpt-5.6", prompt=prompt)


def responses_case() -> tuple[Api, Callable[..., Any]]:
    api = Api(
        RESPONSE_CALLS,
        RESPONSE_FINAL,
        lambda body: any(
            isinstance(item, dict) and item.get("type") == "function_call_output"
            for item in body["input"]
        ),
    )
    client = openai.AsyncOpenAI(
        api_key="test",
        base_url="http://openai.test/v1",
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(api)),
        max_retries=0,
    )
    return api, rl_openai.openai_responses_policy(client, model="gpt-5.6", prompt=prompt)


def tool_ids(answer: dict[str, Any]) -> list[str]:
    """The provider's ids of the tool calls in a canned answer, in order."""
    if "content" in answer:  # Anthropic
        return [b["id"] for b in answer["content"] if b["type"] == "tool_use"]
    if "choices" in answer:  # Chat Completions
        return [c["id"] for c in answer["choices"][0]["message"]["tool_calls"]]
    return [i["call_id"] for i in answer["output"] if i["type"] == "function_call"]


def essential(answer: dict[str, Any]) -> str:
    """The key of an answer that holds what the model said."""
    return next(k for k in ("content", "choices", "output") if k in answer)


def results_sent(body: dict[str, Any]) -> dict[str, str]:
    """``{provider id: result text}`` of the tool results in a request body."""
    if "input" in body:
        return {
            i["call_id"]: i["output"]
            for i in body["input"]
            if isinstance(i, dict) and i.get("type") == "function_call_output"
        }
    last = body["messages"][-1]
    if last["role"] == "tool":
        return {m["tool_call_id"]: m["content"] for m in body["messages"] if m["role"] == "tool"}
    if not isinstance(last["content"], list):
        return {}
    return {b["tool_use_id"]: b["content"] for b in last["content"] if b["type"] == "tool_result"}


@pytest.mark.parametrize("case", [anthropic_case, chat_case, responses_case])
async def test_an_sdk_policy_through_the_worker(
    case: Callable[[], tuple[Api, Callable[..., Any]]], db: Db, start_worker: StartWorker
) -> None:
    api, policy = case()
    seen: list[str] = []
    flow = weather(f"sdk-{case.__name__.removesuffix('_case')}", policy, seen)
    await start_worker(flow)
    for run_id in RUNS:
        await db.submit(run_id, flow)
    for run_id in RUNS:
        run = await db.wait_status(run_id, "succeeded", "failed", "paused")
        assert run["status"] == "succeeded", run

    # one model request per turn: two per run
    assert len(api.bodies) == 2 * len(RUNS)
    keys = [f"{run_id}:0:{c}" for run_id in RUNS for c in ("c0", "c1")]
    assert sorted(seen) == sorted(keys)  # each tool once per key, runledger's keys
    ids = tool_ids(api.first)
    assert len(ids) == 2
    for run_id in RUNS:
        turns = await db.turns(run_id)
        assert [t["turn"] for t in turns] == [0, 1]  # one decision row per turn
        first = turns[0]["record"]
        # the answer journaled verbatim (as JSON): reasoning, signatures, ids, usage
        # (the Responses record leaves out the request's echo: instructions, tools, ...)
        assert essential(api.first) in first
        assert first == {k: json.loads(json.dumps(api.first[k])) for k in first}
        calls = await db.calls(run_id)
        assert [c["provider_id"] for c in calls] == ids  # the same ids in both runs
        assert [c["idempotency_key"] for c in calls] == [f"{run_id}:0:c0", f"{run_id}:0:c1"]
    # every second request carries the results under the provider's ids
    followups = [b for b in api.bodies if results_sent(b)]
    assert len(followups) == len(RUNS)
    for body in followups:
        sent = results_sent(body)
        assert list(sent) == ids
        assert json.loads(sent[ids[0]]) == {"temp": 21, "unit": "celsius"}
        assert sent[ids[1]] == "12:00"
