"""Responses: a ``Response`` into a :class:`~runledger.Decision` (its output items kept
exactly), the history back into ``input``, and a policy making one ``responses.create``
per turn."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, overload

import openai  # the package's __init__ imported it first, through _shared's check

from runledger.flows import Decision, HistoryTurn, PolicyContext, ToolCall
from runledger.integrations._history import Prompt, UnusableHistory
from runledger.integrations._history import initial_messages as _initial
from runledger.integrations._history import pair_calls as _pair
from runledger.integrations.openai._shared import (
    AsyncPolicy,
    SyncPolicy,
    UnsupportedToolCall,
    _arguments,
    _describe,
    _json,
    _output,
    _policy,
    _record,
    _warn_retries,
)

# Output items the client must act on that runledger does not turn into calls.
_CLIENT_SIDE = frozenset(
    {
        "custom_tool_call",
        "computer_call",
        "local_shell_call",
        "shell_call",
        "apply_patch_call",
        "mcp_approval_request",
    }
)
# What a Responses record keeps of the response: not the echo of the request
# (instructions, tools, ...), which would be stored again with every turn.
_RESPONSE_KEEP = (
    "id",
    "object",
    "created_at",
    "model",
    "status",
    "error",
    "incomplete_details",
    "usage",
    "output",
)
_RESPONSES_BUILT = frozenset({"input", "stream", "previous_response_id", "conversation"})


def decision_from_response(
    response: openai.types.responses.Response | Mapping[str, Any],
) -> Decision:
    """The :class:`Decision` of a response.

    ``calls``: one :class:`ToolCall` per ``function_call`` output item, in order:
    ``ToolCall(name, json.loads(arguments), provider_id=call_id)``. ``record``: the
    response's ``id``, ``model``, ``status``, ``usage`` (and ``error``,
    ``incomplete_details``) and its ``output`` items exactly as the API returned them
    (``reasoning`` items with their ids and ``encrypted_content``, ``message`` and
    ``function_call`` items); the echo of the request (``instructions``, ``tools``, ...)
    is left out. ``output``: when there is no function call, the text of the
    ``output_text`` parts of its messages.

    Hosted tools (web search, file search, ...) ran at OpenAI: their items stay in the
    record and are re-sent. Items the client must act on other than ``function_call``
    (custom tools, computer use, shell, apply_patch, MCP approvals) raise
    :class:`UnsupportedToolCall`.
    """
    data = _json(response, "openai.types.responses.Response")
    if not _is_response(data):
        raise TypeError(
            f"expected a Responses API response (an object with 'output'), got {_describe(data)}"
        )
    record = {key: data[key] for key in _RESPONSE_KEEP if key in data}
    calls: list[ToolCall] = []
    texts: list[str] = []
    for position, item in enumerate(record["output"]):
        if not isinstance(item, dict):
            raise TypeError(f"output item {position} is not an object: {item!r}")
        kind = item.get("type")
        if kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise TypeError(f"function_call item {position} has no name or call_id: {item!r}")
            calls.append(
                ToolCall(
                    name, _arguments(name, call_id, item.get("arguments")), provider_id=call_id
                )
            )
        elif kind in _CLIENT_SIDE:
            raise UnsupportedToolCall(
                f"output item {position} is a {kind!r}; only 'function_call' items are run"
            )
        elif kind == "message":
            for part in item.get("content") or ():
                if isinstance(part, dict) and part.get("type") == "output_text":
                    text = part.get("text")
                    if isinstance(text, str):
                        texts.append(text)
    return Decision(calls=tuple(calls), record=record, output=None if calls else "".join(texts))


def input_from_history(
    prompt_or_input: Prompt, history: Sequence[HistoryTurn]
) -> list[dict[str, Any]]:
    """The ``input`` for the next ``client.responses.create(...)``.

    First the conversation before the first turn (a ``str`` becomes one user message; a
    list of input items is copied as it is), then for each turn: the ``output`` items of
    its ``record`` re-sent exactly as they were, followed by one
    ``{"type": "function_call_output", "call_id": <provider_id>, "output": ...}`` item
    per ``function_call``, in order. ``output`` is the call's result (a string as it
    is, anything else as JSON text); for a call that did not succeed it is
    ``{"error": ...}`` as JSON text.

    The whole conversation is sent every time (no ``previous_response_id``), so it works
    with ``store=False`` (then ask for ``include=["reasoning.encrypted_content"]``) and
    after a worker crash. Raises :class:`UnusableHistory` when a turn cannot be rebuilt.
    """
    items = _initial(prompt_or_input)
    for turn in history:
        record = _record(turn)
        if not _is_response(record):
            raise UnusableHistory(
                f"turn {turn.turn}'s record is not a Responses API response ({_describe(record)})"
            )
        output: list[Any] = record["output"]
        items.extend(copy.deepcopy(output))
        ids = [
            item.get("call_id")
            for item in output
            if isinstance(item, dict) and item.get("type") == "function_call"
        ]
        for pid, call in _pair(turn, ids):
            items.append({"type": "function_call_output", "call_id": pid, "output": _output(call)})
    return items


def _is_response(data: object) -> bool:
    return (
        isinstance(data, dict)
        and data.get("object", "response") == "response"
        and isinstance(data.get("output"), list)
    )


@overload
def openai_responses_policy(
    client: openai.OpenAI,
    *,
    model: str,
    prompt: Callable[[PolicyContext], Prompt],
    tools: Sequence[Mapping[str, Any]] = (),
    instructions: str | None = None,
    **create: Any,
) -> SyncPolicy: ...


@overload
def openai_responses_policy(
    client: openai.AsyncOpenAI,
    *,
    model: str,
    prompt: Callable[[PolicyContext], Prompt],
    tools: Sequence[Mapping[str, Any]] = (),
    instructions: str | None = None,
    **create: Any,
) -> AsyncPolicy: ...


def openai_responses_policy(
    client: openai.OpenAI | openai.AsyncOpenAI,
    *,
    model: str,
    prompt: Callable[[PolicyContext], Prompt],
    tools: Sequence[Mapping[str, Any]] = (),
    instructions: str | None = None,
    **create: Any,
) -> SyncPolicy | AsyncPolicy:
    """A policy ``(ctx, history) -> Decision``: one ``responses.create`` per turn, the
    whole conversation sent each time (:func:`input_from_history`).

    ``prompt(ctx)`` gives the input before the first turn; ``tools`` the function tool
    definitions; ``instructions`` the system prompt; ``create`` is passed to ``create``
    as it is (``reasoning``, ``store``, ``include``, ...). With ``store=False``, pass
    ``include=["reasoning.encrypted_content"]`` so reasoning items can be re-sent. Build
    the client with ``max_retries=0``: runledger retries the policy itself, and it is
    never called twice for a recorded turn.
    """
    bad = _RESPONSES_BUILT & create.keys()
    if bad:
        raise ValueError(f"openai_responses_policy builds {sorted(bad)} itself")
    _warn_retries("openai_responses_policy", client)

    def request(ctx: PolicyContext, history: Sequence[HistoryTurn]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"model": model, "input": input_from_history(prompt(ctx), history)}
        if tools:
            kwargs["tools"] = [dict(t) for t in tools]
        if instructions is not None:
            kwargs["instructions"] = instructions
        kwargs.update(create)
        return kwargs

    is_async = isinstance(client, openai.AsyncOpenAI)
    return _policy(client.responses.create, is_async, request, decision_from_response)
