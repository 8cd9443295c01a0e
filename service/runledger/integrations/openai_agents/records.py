"""The journal's side of the OpenAI Agents SDK adapter: a ``ModelResponse`` as a turn's
record, the ``function_call_output`` a call's result becomes, and a tool's failure as
the ``NotApplied`` reason a failed call keeps."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, cast

import pydantic_core
from agents.items import ModelResponse, TResponseInputItem, TResponseOutputItem
from agents.usage import Usage
from pydantic import TypeAdapter

from runledger.flows import HistoryCall, NotApplied

MARK = "openai_agents"  # key of the JSON a NotApplied reason carries for an adapter failure

_ITEM: TypeAdapter[Any] = TypeAdapter(TResponseOutputItem)
_USAGE: TypeAdapter[Usage] = TypeAdapter(Usage)


def _dump_item(item: Any) -> dict[str, Any]:
    if isinstance(item, Mapping):
        return cast(dict[str, Any], pydantic_core.to_jsonable_python(dict(item)))
    # the fields the model set, as ``ModelResponse.to_input_items`` replays them
    return cast(dict[str, Any], item.model_dump(mode="json", exclude_unset=True))


def response_to_record(response: ModelResponse) -> dict[str, Any]:
    """The ``ModelResponse`` as JSON (``Decision.record``): its output items exactly as the
    model gave them (the fields it set), its usage and its ids."""
    record: dict[str, Any] = {
        "output": [_dump_item(item) for item in response.output],
        "usage": _USAGE.dump_python(response.usage, mode="json"),
        "response_id": response.response_id,
    }
    if response.request_id is not None:
        record["request_id"] = response.request_id
    return record


def _output_items(record: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    if record is None:
        raise ValueError("the turn has no record: it was not decided by agent_flow")
    items = record.get("output")
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ValueError("the turn's record is not an Agents SDK model response (no output items)")
    return [dict(i) for i in items]


def record_to_response(record: Mapping[str, Any] | None) -> ModelResponse:
    """The ``ModelResponse`` a turn's ``record`` holds (output items as the SDK's types)."""
    items = _output_items(record)
    assert record is not None
    usage = record.get("usage")
    return ModelResponse(
        output=[_ITEM.validate_python(item) for item in items],
        usage=_USAGE.validate_python(usage) if usage is not None else Usage(),
        response_id=record.get("response_id"),
        request_id=record.get("request_id"),
    )


def replayed_items(record: Mapping[str, Any] | None) -> list[TResponseInputItem]:
    """The record's output items as the next request's input items, the way the runner
    replays a response (``to_input_items``; a ``status`` of None is left out)."""
    response = ModelResponse(
        output=cast(Any, _output_items(record)), usage=Usage(), response_id=None
    )
    out: list[TResponseInputItem] = []
    for item in response.to_input_items():
        if isinstance(item, dict) and item.get("status", "") is None:
            item = cast(TResponseInputItem, {k: v for k, v in item.items() if k != "status"})
        out.append(item)
    return out


def function_calls(items: list[dict[str, Any]] | list[Any]) -> list[Any]:
    """The ``function_call`` items of a response, in order (dicts or SDK objects)."""
    return [i for i in items if _get(i, "type") == "function_call"]


def _get(item: Any, key: str) -> Any:
    return item.get(key) if isinstance(item, Mapping) else getattr(item, key, None)


def call_output(call: HistoryCall) -> Any:
    """A succeeded call's result as the ``output`` of its ``function_call_output``: the
    tool journals what the SDK makes of its return value (a string, or a list of
    structured outputs); a receipt found by a lookup is a dict, sent as JSON text."""
    result = call.result
    if isinstance(result, str | list):
        return result
    return json.dumps(result, ensure_ascii=False, separators=(",", ":"))


# -- failures ----------------------------------------------------------------------------


def not_applied(reason: str, output: str | None, *, retry: bool = False) -> NotApplied:
    """A call that certainly did not take effect, with what the model is to be shown
    (``output`` None: the tool has no ``failure_error_function``, the run fails)."""
    return NotApplied(
        json.dumps({MARK: "failed", "reason": reason, "output": output}, default=str), retry=retry
    )


def failure(call: HistoryCall) -> tuple[bool, str | None, str]:
    """``(rendered, output, message)`` of a failed call: the output the tool's failure
    function gave when the call failed (``rendered``), or else the message the failure
    function is to be given now (the exception's text, or runledger's reason as JSON)."""
    error = call.error if isinstance(call.error, dict) else {}
    reason = error.get("reason")
    if isinstance(reason, str):
        try:
            raised = json.loads(reason)
        except ValueError:
            raised = None
        if isinstance(raised, dict) and raised.get(MARK) == "failed":
            output = raised.get("output")
            return True, output if isinstance(output, str) else None, str(raised.get("reason"))
    message = error.get("message")
    if isinstance(message, str) and set(error) <= {"type", "message"}:
        return False, None, message
    return False, None, json.dumps(call.error, sort_keys=True, default=str)
