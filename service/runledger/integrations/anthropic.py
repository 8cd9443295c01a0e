"""Helpers for the bare Anthropic SDK (Messages API); extra ``runledger-pg[anthropic]``.

- :func:`decision_from_message`: a ``Message`` (or its JSON) into a :class:`Decision` whose
  ``record`` is the message exactly as the API returned it;
- :func:`messages_from_history`: the history back into the ``messages`` of the next
  ``client.messages.create(...)``: each recorded assistant message re-sent unchanged
  (thinking signatures intact), then its ``tool_result`` blocks;
- :func:`anthropic_policy`: a policy that makes one ``messages.create`` per turn.

Provider ids (``tool_use.id``) only map results back into the messages: the decision's
calls leave ``call_id`` unset, so runledger numbers them (``c0``, ``c1``, ...) and the
idempotency keys never depend on what the model answered.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, overload

try:
    import anthropic
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "runledger.integrations.anthropic needs the Anthropic SDK: "
        "pip install 'runledger-pg[anthropic]'"
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
from runledger.integrations._history import abandoned as _abandoned
from runledger.integrations._history import initial_messages as _initial
from runledger.integrations._history import pair_calls as _pair

__all__ = [
    "UnusableHistory",
    "anthropic_policy",
    "decision_from_message",
    "messages_from_history",
]

log = logging.getLogger(__name__)


SyncPolicy = Callable[[PolicyContext, Sequence[HistoryTurn]], Decision]
AsyncPolicy = Callable[[PolicyContext, Sequence[HistoryTurn]], Awaitable[Decision]]


# -- a response into a decision --------------------------------------------------------


def decision_from_message(message: anthropic.types.Message | Mapping[str, Any]) -> Decision:
    """The :class:`Decision` of one assistant message.

    ``calls``: one :class:`ToolCall` per ``tool_use`` block, in order, with
    ``provider_id=block.id`` and no ``call_id``. ``record``: the whole message as JSON,
    exactly as the API returned it (``id``, ``model``, ``stop_reason``, ``usage`` and
    every content block, ``thinking`` with its ``signature`` and ``redacted_thinking``
    included; fields this SDK does not know are kept too). ``output``: when there is no
    ``tool_use``, the text of the message (its text blocks joined), which ends the run.

    A message without ``tool_use`` ends the run whatever its ``stop_reason``
    (``max_tokens``, ``pause_turn``, ``refusal``): check ``decision.record["stop_reason"]``
    in your policy to do otherwise. Server tools (``server_tool_use`` and their results)
    ran at Anthropic; they stay in the record and are re-sent with it.
    """
    record = _message_json(message)
    calls: list[ToolCall] = []
    texts: list[str] = []
    for position, block in enumerate(record["content"]):
        if not isinstance(block, dict):
            raise TypeError(f"content block {position} is not an object: {block!r}")
        kind = block.get("type")
        if kind == "tool_use":
            name, block_id, args = block.get("name"), block.get("id"), block.get("input")
            if not isinstance(name, str) or not isinstance(block_id, str):
                raise TypeError(f"tool_use block {position} has no name or id: {block!r}")
            if not isinstance(args, dict):
                raise InvalidDecision(
                    f"tool {name} (tool_use {block_id}): input is not a JSON object: {args!r}"
                )
            calls.append(ToolCall(name, copy.deepcopy(args), provider_id=block_id))
        elif kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
    return Decision(calls=tuple(calls), record=record, output=None if calls else "".join(texts))


def _message_json(message: object) -> dict[str, Any]:
    if isinstance(message, anthropic.BaseModel):
        # the fields the API sent, under the API's names, unknown ones included
        data: object = message.to_dict(mode="json")
    elif isinstance(message, Mapping):
        try:
            data = json.loads(json.dumps(message, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"the message is not JSON: {exc}") from exc
    else:
        raise TypeError(
            f"expected an anthropic.types.Message or its JSON, got {type(message).__name__}"
        )
    if not _is_message(data):
        raise TypeError(
            "expected an assistant message of the Messages API (role 'assistant', a list "
            f"of content blocks), got {_describe(data)}"
        )
    assert isinstance(data, dict)
    return data


def _is_message(data: object) -> bool:
    return (
        isinstance(data, dict)
        and data.get("role") == "assistant"
        and isinstance(data.get("content"), list)
        and data.get("type", "message") == "message"
    )


def _describe(data: object) -> str:
    if isinstance(data, dict):
        return f"an object with keys {sorted(data)[:8]}"
    return type(data).__name__


# -- the history back into messages ----------------------------------------------------


def messages_from_history(
    prompt_or_messages: Prompt, history: Sequence[HistoryTurn]
) -> list[dict[str, Any]]:
    """The ``messages`` for the next ``client.messages.create(...)``.

    First the conversation before the first turn (a ``str`` becomes one user message;
    a list of messages is copied as it is), then for each turn of ``history``:

    - the assistant message rebuilt from the turn's ``record``: ``role`` and its
      ``content`` blocks exactly as recorded (the API rejects a modified thinking block);
    - one user message with a ``tool_result`` block per ``tool_use`` of the record, in
      the record's order: ``tool_use_id`` is the call's ``provider_id``; ``content`` is
      the call's result (a string as it is, anything else as JSON text); a call that did
      not succeed has ``is_error: true`` and its error as content (a call an operator
      gave up on: that it may or may not have taken effect and must not be repeated,
      with the operator's note).

    Calls without a ``provider_id`` (added by the policy, not asked by the model) are
    not shown to the model. Raises :class:`UnusableHistory` when a turn cannot be
    rebuilt. The result is a fresh copy: changing it does not change the history.
    """
    messages = _initial(prompt_or_messages)
    for turn in history:
        record = turn.record
        if record is None:
            raise UnusableHistory(
                f"turn {turn.turn} has no record: it was not decided through "
                "decision_from_message (a policy returning a bare list of ToolCall, or a "
                "worker too old to store the record)"
            )
        if not _is_message(record):
            raise UnusableHistory(
                f"turn {turn.turn}'s record is not an Anthropic message ({_describe(record)})"
            )
        content: list[Any] = record["content"]
        messages.append({"role": "assistant", "content": copy.deepcopy(content)})
        ids = [
            block.get("id")
            for block in content
            if isinstance(block, dict) and block.get("type") == "tool_use"
        ]
        results = [_tool_result(pid, call) for pid, call in _pair(turn, ids)]
        if results:
            messages.append({"role": "user", "content": results})
    return messages


def _tool_result(tool_use_id: str, call: HistoryCall) -> dict[str, Any]:
    if call.status == "succeeded":
        return {"type": "tool_result", "tool_use_id": tool_use_id, "content": _text(call.result)}
    return {
        "type": "tool_result",
        "tool_use_id": tool_use_id,
        "content": _text(_failure(call)),
        "is_error": True,
    }


def _failure(call: HistoryCall) -> Any:
    """What the model is told of a call that did not succeed: its error, and its status
    when that is not plain ``failed``; for a call an operator gave up on, that it may
    have taken effect and must not be repeated, with the operator's note."""
    given_up = _abandoned(call)
    if given_up is not None:
        return given_up
    if call.status == "failed" and call.error is not None:
        return call.error
    return {"status": call.status, "error": call.error}


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# -- a policy ----------------------------------------------------------------------------


_BUILT = frozenset({"messages", "stream"})


@overload
def anthropic_policy(
    client: anthropic.Anthropic,
    *,
    model: str,
    prompt: Callable[[PolicyContext], Prompt],
    tools: Sequence[Mapping[str, Any]] = (),
    system: str | Sequence[Mapping[str, Any]] | None = None,
    max_tokens: int = 4096,
    **create: Any,
) -> SyncPolicy: ...


@overload
def anthropic_policy(
    client: anthropic.AsyncAnthropic,
    *,
    model: str,
    prompt: Callable[[PolicyContext], Prompt],
    tools: Sequence[Mapping[str, Any]] = (),
    system: str | Sequence[Mapping[str, Any]] | None = None,
    max_tokens: int = 4096,
    **create: Any,
) -> AsyncPolicy: ...


def anthropic_policy(
    client: anthropic.Anthropic | anthropic.AsyncAnthropic,
    *,
    model: str,
    prompt: Callable[[PolicyContext], Prompt],
    tools: Sequence[Mapping[str, Any]] = (),
    system: str | Sequence[Mapping[str, Any]] | None = None,
    max_tokens: int = 4096,
    **create: Any,
) -> SyncPolicy | AsyncPolicy:
    """A policy ``(ctx, history) -> Decision`` that makes one ``messages.create`` per turn.

    ``prompt(ctx)`` gives the conversation before the first turn (a ``str`` or messages);
    ``tools`` are the tool definitions sent to the model (each ``name`` must be a tool of
    the flow); ``create`` is passed to ``messages.create`` as it is (``thinking``,
    ``tool_choice``, ``temperature``, ...). With an ``AsyncAnthropic`` client the policy
    is ``async`` (cancellable when the lease is lost); with ``Anthropic`` it runs in a
    thread.

    Build the client with ``max_retries=0``: runledger retries a failed policy itself
    (``policy_attempts``, with backoff) and SDK retries inside would multiply them and
    can outlast the lease. The policy is never called twice for a recorded turn; a
    request that failed before the turn was recorded is simply asked again.
    """
    bad = _BUILT & create.keys()
    if bad:
        raise ValueError(f"anthropic_policy builds {sorted(bad)} itself")
    if client.max_retries:
        log.warning(
            "anthropic_policy: the client retries %d times itself; runledger retries the "
            "policy: build it with max_retries=0",
            client.max_retries,
        )

    def request(ctx: PolicyContext, history: Sequence[HistoryTurn]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "messages": messages_from_history(prompt(ctx), history),
        }
        if tools:
            kwargs["tools"] = [dict(t) for t in tools]
        if system is not None:
            kwargs["system"] = system if isinstance(system, str) else [dict(s) for s in system]
        kwargs.update(create)
        return kwargs

    if isinstance(client, anthropic.AsyncAnthropic):
        async_client = client

        async def decide_async(ctx: PolicyContext, history: Sequence[HistoryTurn]) -> Decision:
            message = await async_client.messages.create(**request(ctx, history))
            return decision_from_message(message)

        return decide_async

    sync_client = client

    def decide(ctx: PolicyContext, history: Sequence[HistoryTurn]) -> Decision:
        message = sync_client.messages.create(**request(ctx, history))
        return decision_from_message(message)

    return decide
