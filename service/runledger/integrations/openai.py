"""Helpers for the bare OpenAI SDK (Chat Completions and Responses); extra
``runledger-pg[openai]``.

Chat Completions:

- :func:`decision_from_chat_completion`: a ``ChatCompletion`` into a :class:`Decision`;
- :func:`messages_from_history`: the history back into ``messages`` (each recorded
  assistant message unchanged, then one ``{"role": "tool", ...}`` message per call);
- :func:`openai_chat_policy`: one ``chat.completions.create`` per turn.

Responses:

- :func:`decision_from_response`: a ``Response`` into a :class:`Decision` (its output
  items, ``reasoning`` with ``encrypted_content`` included, kept exactly);
- :func:`input_from_history`: the history back into ``input`` (the recorded output items
  re-sent as they were, then one ``function_call_output`` item per call);
- :func:`openai_responses_policy`: one ``responses.create`` per turn.

Provider ids (``tool_calls[].id``, ``call_id``) only map results back: the decision's
calls leave ``call_id`` unset, so runledger numbers them (``c0``, ``c1``, ...) and the
idempotency keys never depend on what the model answered.

The model writes a call's arguments as a JSON string. When that is not a JSON object,
the decision raises :class:`InvalidToolArguments`, an ``InvalidDecision``: nothing is
recorded and nothing runs, and the run fails as ``invalid_decision`` with the tool, the
provider's id and the text in its error (``runledger retry RUN`` asks the model again).
Catch it in your policy to re-ask at once instead. Empty arguments (``""``) are ``{}``.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, overload

try:
    import openai
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "runledger.integrations.openai needs the OpenAI SDK: pip install 'runledger-pg[openai]'"
    ) from exc

from runledger.flows import (
    Decision,
    HistoryCall,
    HistoryTurn,
    InvalidDecision,
    PolicyContext,
    ToolCall,
)
from runledger.integrations._history import (
    Prompt,
    UnusableHistory,
)
from runledger.integrations._history import initial_messages as _initial
from runledger.integrations._history import pair_calls as _pair

__all__ = [
    "InvalidToolArguments",
    "UnsupportedToolCall",
    "UnusableHistory",
    "decision_from_chat_completion",
    "decision_from_response",
    "input_from_history",
    "messages_from_history",
    "openai_chat_policy",
    "openai_responses_policy",
]

log = logging.getLogger(__name__)


SyncPolicy = Callable[[PolicyContext, Sequence[HistoryTurn]], Decision]
AsyncPolicy = Callable[[PolicyContext, Sequence[HistoryTurn]], Awaitable[Decision]]

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


class InvalidToolArguments(InvalidDecision):
    """The model's arguments for a tool call are not a JSON object."""

    def __init__(self, *, tool: str, provider_id: str, arguments: str, reason: str) -> None:
        super().__init__(
            f"tool {tool} (call {provider_id}): the model's arguments are not a JSON object "
            f"({reason}): {arguments[:500]!r}"
        )
        self.tool = tool
        self.provider_id = provider_id
        self.arguments = arguments


class UnsupportedToolCall(InvalidDecision):
    """The model asked for a kind of call these helpers do not run (custom tools, the
    legacy ``function_call``, computer use, local shell, apply_patch, MCP approvals)."""


# -- Chat Completions ------------------------------------------------------------------


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


# -- Responses -------------------------------------------------------------------------


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


# -- shared --------------------------------------------------------------------------


def _json(value: object, expected: str) -> dict[str, Any]:
    if isinstance(value, openai.BaseModel):
        # the fields the API sent, under the API's names, unknown ones included
        data: object = value.to_dict(mode="json")
    elif isinstance(value, Mapping):
        try:
            data = json.loads(json.dumps(value, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"the answer is not JSON: {exc}") from exc
    else:
        raise TypeError(f"expected an {expected} or its JSON, got {type(value).__name__}")
    if not isinstance(data, dict):
        raise TypeError(f"expected an {expected} or its JSON, got {type(data).__name__}")
    return data


def _arguments(tool: str, provider_id: str, arguments: object) -> dict[str, Any]:
    if not isinstance(arguments, str):
        raise InvalidToolArguments(
            tool=tool, provider_id=provider_id, arguments=repr(arguments), reason="not a string"
        )
    if not arguments.strip():
        return {}
    try:
        args = json.loads(arguments)
    except ValueError as exc:
        raise InvalidToolArguments(
            tool=tool, provider_id=provider_id, arguments=arguments, reason=str(exc)
        ) from exc
    if not isinstance(args, dict):
        raise InvalidToolArguments(
            tool=tool,
            provider_id=provider_id,
            arguments=arguments,
            reason=f"a JSON {type(args).__name__}",
        )
    return args


def _describe(data: object) -> str:
    if isinstance(data, dict):
        return f"an object with keys {sorted(data)[:8]}"
    return type(data).__name__


def _record(turn: HistoryTurn) -> dict[str, Any]:
    if turn.record is None:
        raise UnusableHistory(
            f"turn {turn.turn} has no record: it was not decided through these helpers (a "
            "policy returning a bare list of ToolCall, or a worker too old to store the record)"
        )
    return turn.record


def _output(call: HistoryCall) -> str:
    """What the model is told of a call: its result, or ``{"error": ...}`` (with the
    status when it is not plain ``failed``)."""
    if call.status == "succeeded":
        value = call.result
    elif call.status == "failed":
        value = {"error": call.error}
    else:
        value = {"error": call.error, "status": call.status}
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _warn_retries(helper: str, client: openai.OpenAI | openai.AsyncOpenAI) -> None:
    if client.max_retries:
        log.warning(
            "%s: the client retries %d times itself; runledger retries the policy: build "
            "it with max_retries=0",
            helper,
            client.max_retries,
        )


# -- policies --------------------------------------------------------------------------


_CHAT_BUILT = frozenset({"messages", "stream"})
_RESPONSES_BUILT = frozenset({"input", "stream", "previous_response_id", "conversation"})


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


def _policy(
    create: Callable[..., Any],
    is_async: bool,
    request: Callable[[PolicyContext, Sequence[HistoryTurn]], dict[str, Any]],
    convert: Callable[[Any], Decision],
) -> SyncPolicy | AsyncPolicy:
    """A policy making one ``create(**request(ctx, history))`` per turn, ``convert``-ed."""
    if is_async:

        async def decide_async(ctx: PolicyContext, history: Sequence[HistoryTurn]) -> Decision:
            return convert(await create(**request(ctx, history)))

        return decide_async

    def decide(ctx: PolicyContext, history: Sequence[HistoryTurn]) -> Decision:
        return convert(create(**request(ctx, history)))

    return decide
