"""What the Chat Completions and Responses helpers share: the OpenAI SDK import, the
typed refusals, the JSON of an answer, a call's arguments and output, the policy shape."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

try:
    import openai
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "runledger.integrations.openai needs the OpenAI SDK: pip install 'runledger-pg[openai]'"
    ) from exc

from runledger.flows import Decision, HistoryCall, HistoryTurn, InvalidDecision, PolicyContext
from runledger.integrations._history import UnusableHistory, abandoned

log = logging.getLogger("runledger.integrations.openai")

SyncPolicy = Callable[[PolicyContext, Sequence[HistoryTurn]], Decision]
AsyncPolicy = Callable[[PolicyContext, Sequence[HistoryTurn]], Awaitable[Decision]]


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
    status when it is not plain ``failed``; for a call an operator gave up on, the error
    says it may have taken effect and must not be repeated, with the operator's note)."""
    given_up = abandoned(call)
    if call.status == "succeeded":
        value = call.result
    elif given_up is not None:
        value = {"error": given_up}
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
