"""The journal's side of the Pydantic AI adapter: a ``ModelResponse`` as a turn's record,
and a tool's Pydantic AI failure as the ``NotApplied`` reason a failed call keeps."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, cast

import pydantic_core
from pydantic import ValidationError
from pydantic_ai.exceptions import ModelRetry, ToolFailed
from pydantic_ai.messages import (
    ModelMessagesTypeAdapter,
    ModelResponse,
    ToolReturn,
    ToolReturnPart,
)

from runledger.flows import HistoryCall, NotApplied
from runledger.integrations._history import abandoned

MARK = "pydantic_ai"  # key of the JSON a NotApplied reason carries for a Pydantic AI failure


def response_to_record(response: ModelResponse) -> dict[str, Any]:
    """The ``ModelResponse`` as JSON (``Decision.record``), by ``ModelMessagesTypeAdapter``."""
    dumped = ModelMessagesTypeAdapter.dump_python([response], mode="json")
    return cast(dict[str, Any], dumped[0])


def record_to_response(record: Mapping[str, Any] | None) -> ModelResponse:
    """The ``ModelResponse`` a turn's ``record`` holds."""
    if record is None:
        raise ValueError("the turn has no record: it was not decided by agent_flow")
    [message] = ModelMessagesTypeAdapter.validate_python([dict(record)])
    if not isinstance(message, ModelResponse):
        raise ValueError(f"the turn's record is a {message.kind}, not a model response")
    return message


def tool_result(value: Any) -> Any:
    """A tool's return value as JSON (a ``ToolReturn``'s ``return_value``)."""
    if isinstance(value, ToolReturn):
        value = value.return_value
    return pydantic_core.to_jsonable_python(value, fallback=str)


def validation_content(exc: ValidationError) -> Any:
    """What ``agent.run`` shows the model for arguments that fail validation, made by
    Pydantic AI itself: the error details (``errors(include_url=False,
    include_context=False)``, what a tool's retry is built from) loaded as a stored retry
    prompt of a tool, which Pydantic AI turns into the retried ``ToolReturnPart`` it sends
    (each detail without its ``ctx``, a repeated top-level ``input`` once), as JSON."""
    details = exc.errors(include_url=False, include_context=False)
    stored = {
        "part_kind": "retry-prompt",
        "content": details,
        "tool_name": "t",
        "tool_call_id": "t",
    }
    [request] = ModelMessagesTypeAdapter.validate_python([{"kind": "request", "parts": [stored]}])
    [part] = request.parts
    if not isinstance(part, ToolReturnPart):
        raise TypeError(f"a stored retry prompt of a tool loaded as a {type(part).__name__}")
    return pydantic_core.to_jsonable_python(part.content, fallback=str)


def not_applied(kind: str, content: Any, cause: str | None = None) -> NotApplied:
    return NotApplied(json.dumps({MARK: kind, "cause": cause, "content": content}, default=str))


def model_visible(exc: ModelRetry | ToolFailed) -> NotApplied:
    if isinstance(exc, ModelRetry):
        return not_applied("retried", exc.message, "model_retry")
    return not_applied("failed", exc.message)


def failure(call: HistoryCall) -> tuple[str, Any, Any]:
    """``(kind, cause, content)`` of a failed call: what the tool raised, an operator's
    ``abandoned`` (it may have taken effect), a person's denial, or runledger's own
    reason (``failed``: the call did not take effect and will not be repeated)."""
    given_up = abandoned(call)
    if given_up is not None:
        return "failed", None, given_up
    error = call.error if isinstance(call.error, dict) else {}
    reason = error.get("reason")
    if isinstance(reason, str):
        try:
            raised = json.loads(reason)
        except ValueError:
            raised = None
        if isinstance(raised, dict) and raised.get(MARK) in ("retried", "failed"):
            return raised[MARK], raised.get("cause"), raised.get("content")
    if call.approval == "denied":  # runledger deny KEY --reason ...: a person said no
        note = error.get("note")
        why = f": {note}" if isinstance(note, str) and note else ""
        return "failed", None, f"A person denied this tool call{why}. It was not run."
    detail = json.dumps(call.error, sort_keys=True, default=str)
    return "failed", None, f"The tool call failed and did not take effect: {detail}"
