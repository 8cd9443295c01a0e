"""Chat Completions: a ``ChatCompletion`` into a :class:`~runledger.Decision`, the history
back into ``messages``, and a policy making one ``chat.completions.create`` per turn."""

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

_CHAT_BUILT = frozenset({"messages", "stream"})


def decision_from_chat_completion(
    completion: openai.types.chat.ChatCompletion | Mapping[str, Any],
) -> Decision:
    """The :class:`Decision` of a chat completion's first choice.

    ``calls``: one :class:`ToolCall` per ``function`` tool call of
    ``choices[0].message``, in order: ``ToolCall(function.name,
    json.loads(function.arguments), provider_id=id)``. ``record``: the completion as the
    API returned it (``id``, ``model``, ``usage``, ...), its ``choices`` reduced to the
    first; the assistant message in it is verbatim. ``output``: when there is no tool
    call, the message's ``content`` (``""`` when it has none, e.g. a ``refusal``: see the
    record).
    """
    record = _json(completion, "openai.types.chat.ChatCompletion")
    if not _is_chat_completion(record):
        raise TypeError(
            "expected a chat completion (an object with 'choices' holding an assistant "
            f"message), got {_describe(record)}"
        )
    record["choices"] = record["choices"][:1]
    message: dict[str, Any] = record["choices"][0]["message"]
    calls: list[ToolCall] = []
    for position, tool_call in enumerate(message.get("tool_calls") or ()):
        if not isinstance(tool_call, dict):
            raise TypeError(f"tool call {position} is not an object: {tool_call!r}")
        provider_id, kind = tool_call.get("id"), tool_call.get("type")
        if kind != "function":
            raise UnsupportedToolCall(
                f"tool call {provider_id} is of type {kind!r}; only 'function' tool calls "
                "are supported"
            )
        function = tool_call.get("function")
        if not isinstance(function, dict) or not isinstance(provider_id, str):
            raise TypeError(f"tool call {position} has no function or id: {tool_call!r}")
        name = function.get("name")
        if not isinstance(name, str):
            raise TypeError(f"tool call {provider_id} has no function name: {tool_call!r}")
        args = _arguments(name, provider_id, function.get("arguments"))
        calls.append(ToolCall(name, args, provider_id=provider_id))
    if not calls and message.get("function_call"):
        raise UnsupportedToolCall(
            "the model answered with the legacy 'function_call'; declare the functions as "
            "'tools' instead"
        )
    content = message.get("content")
    output = None if calls else (content if isinstance(content, str) else "")
    return Decision(calls=tuple(calls), record=record, output=output)


def messages_from_history(
    prompt_or_messages: Prompt, history: Sequence[HistoryTurn]
) -> list[dict[str, Any]]:
    """The ``messages`` for the next ``client.chat.completions.create(...)``.

    First the conversation before the first turn (a ``str`` becomes one user message; a
    list of messages, system or developer ones included, is copied as it is), then for
    each turn: the assistant message of its ``record`` exactly as recorded, followed by
    one ``{"role": "tool", "tool_call_id": <provider_id>, "content": ...}`` message per
    tool call, in the message's order. ``content`` is the call's result (a string as it
    is, anything else as JSON text); for a call that did not succeed it is
    ``{"error": ...}`` as JSON text.

    Calls without a ``provider_id`` are not shown to the model. Raises
    :class:`UnusableHistory` when a turn cannot be rebuilt. The result is a fresh copy.
    """
    messages = _initial(prompt_or_messages)
    for turn in history:
        record = _record(turn)
        if not _is_chat_completion(record):
            raise UnusableHistory(
                f"turn {turn.turn}'s record is not a chat completion ({_describe(record)})"
            )
        message: dict[str, Any] = record["choices"][0]["message"]
        messages.append(copy.deepcopy(message))
        ids = [
            tool_call.get("id")
            for tool_call in message.get("tool_calls") or ()
            if isinstance(tool_call, dict)
        ]
        for pid, call in _pair(turn, ids):
            messages.append({"role": "tool", "tool_call_id": pid, "content": _output(call)})
    return messages


def _is_chat_completion(data: object) -> bool:
    if not isinstance(data, dict) or data.get("object", "chat.completion") != "chat.completion":
        return False
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    message = choices[0].get("message")
    return isinstance(message, dict) and message.get("role") == "assistant"


@overload
def openai_chat_policy(
    client: openai.OpenAI,
    *,
    model: str,
    prompt: Callable[[PolicyContext], Prompt],
    tools: Sequence[Mapping[str, Any]] = (),
    **create: Any,
) -> SyncPolicy: ...


@overload
def openai_chat_policy(
    client: openai.AsyncOpenAI,
    *,
    model: str,
    prompt: Callable[[PolicyContext], Prompt],
    tools: Sequence[Mapping[str, Any]] = (),
    **create: Any,
) -> AsyncPolicy: ...


def openai_chat_policy(
    client: openai.OpenAI | openai.AsyncOpenAI,
    *,
    model: str,
    prompt: Callable[[PolicyContext], Prompt],
    tools: Sequence[Mapping[str, Any]] = (),
    **create: Any,
) -> SyncPolicy | AsyncPolicy:
    """A policy ``(ctx, history) -> Decision``: one ``chat.completions.create`` per turn.

    ``prompt(ctx)`` gives the conversation before the first turn (a ``str``, or messages
    starting with a system or developer message); ``tools`` are the tool definitions
    (each function ``name`` must be a tool of the flow); ``create`` is passed to
    ``create`` as it is. With ``AsyncOpenAI`` the policy is ``async``. Build the client
    with ``max_retries=0``: runledger retries the policy itself, and it is never called
    twice for a recorded turn.
    """
    bad = _CHAT_BUILT & create.keys()
    if bad:
        raise ValueError(f"openai_chat_policy builds {sorted(bad)} itself")
    _warn_retries("openai_chat_policy", client)

    def request(ctx: PolicyContext, history: Sequence[HistoryTurn]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": model,
            "messages": messages_from_history(prompt(ctx), history),
        }
        if tools:
            kwargs["tools"] = [dict(t) for t in tools]
        kwargs.update(create)
        return kwargs

    is_async = isinstance(client, openai.AsyncOpenAI)
    return _policy(client.chat.completions.create, is_async, request, decision_from_chat_completion)
