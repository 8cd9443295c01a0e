"""``--redact``: what a tool was called with and what it or the provider answered is shown
as ``[redacted]``, in the pages and in ``/api`` alike.

Redacted: each call's ``args``, ``result`` and ``receipt``; each turn's decision
``record`` and ``output`` (the model's message holds the calls' arguments verbatim); the
run's ``input``, ``state`` and ``result``. Kept: keys, tools, statuses, attempts, who
did what under which token, errors and notes (what an operator needs to decide), the
evidence of an unknown call included (what its worker asked the provider and saw)."""

from __future__ import annotations

from typing import Any

REDACTED = "[redacted]"
RUN_FIELDS = ("input", "state", "result")
TURN_FIELDS = ("record", "output")
CALL_FIELDS = ("args", "result", "receipt")


def _hide(row: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    return {k: (REDACTED if k in fields and v is not None else v) for k, v in row.items()}


def shown_run(data: dict[str, Any]) -> dict[str, Any]:
    """A :func:`runledger.db.inspect.show_run` document, redacted."""
    return {
        **data,
        "run": _hide(data["run"], RUN_FIELDS),
        "turns": [
            {
                **_hide(turn, TURN_FIELDS),
                "calls": [_hide(call, CALL_FIELDS) for call in turn["calls"]],
            }
            for turn in data["turns"]
        ],
    }
