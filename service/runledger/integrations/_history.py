"""What the adapters share about the history: the prompt before the first turn, pairing
each of a record's tool-call ids with the call of the history that carries it (the
bare-SDK helpers), and what every adapter tells the model of a call an operator gave up on.

No SDK is imported here.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from runledger.flows import HistoryCall, HistoryTurn

Prompt = str | Sequence[Mapping[str, Any]]
"""The conversation before the first turn: a user prompt, or the messages themselves."""


class UnusableHistory(ValueError):
    """The history cannot be turned back into the provider's messages: a turn without a
    record (decided by a bare ``list[ToolCall]``), a record of another provider or API,
    or a tool call of the record without its call (or a call without its tool call)."""


ABANDONED = (
    "This tool call was given up by an operator: it may or may not have taken effect, "
    "so do not repeat it."
)


def abandoned(call: HistoryCall) -> str | None:
    """What the model is told of a call an operator gave up on (``runledger resolve KEY
    abandoned``): :data:`ABANDONED` and the operator's note; None for any other call.

    Such a call is ``failed`` with the error ``{"reason": "abandoned"}`` and, when the
    operator gave one, ``"note"``; a tool's own ``NotApplied("abandoned")`` also carries
    ``"not_applied"`` and is not one. Unlike any other failure it may have taken effect
    (the email may have gone out), so no adapter shows it as a failure that did not.
    """
    error = call.error
    if (
        call.status != "failed"
        or not isinstance(error, dict)
        or error.get("reason") != "abandoned"
        or not set(error) <= {"reason", "note"}
    ):
        return None
    note = error.get("note")
    if isinstance(note, str) and note.strip():
        return f"{ABANDONED} The operator's note: {note.strip()}"
    return ABANDONED


def initial_messages(prompt_or_messages: Prompt) -> list[dict[str, Any]]:
    if isinstance(prompt_or_messages, str):
        return [{"role": "user", "content": prompt_or_messages}]
    if isinstance(prompt_or_messages, Sequence):
        out: list[dict[str, Any]] = []
        for position, message in enumerate(prompt_or_messages):
            if not isinstance(message, Mapping):
                raise TypeError(f"message {position} is {type(message).__name__}, not a dict")
            out.append(copy.deepcopy(dict(message)))
        return out
    raise TypeError(
        f"expected a prompt (str) or a list of messages, got {type(prompt_or_messages).__name__}"
    )


def pair_calls(turn: HistoryTurn, ids: Sequence[object]) -> list[tuple[str, HistoryCall]]:
    """Each of the record's tool-call ids with the call that carries it as provider_id."""
    pending: dict[str, list[HistoryCall]] = {}
    for call in turn.calls:
        if call.provider_id is not None:
            pending.setdefault(call.provider_id, []).append(call)
    pairs: list[tuple[str, HistoryCall]] = []
    for pid in ids:
        queue = pending.get(pid) if isinstance(pid, str) else None
        if not isinstance(pid, str) or not queue:
            raise UnusableHistory(
                f"turn {turn.turn}: the model's tool call {pid!r} has no call in the history "
                "with that provider_id"
            )
        pairs.append((pid, queue.pop(0)))
    left = sorted(call.call_id for queue in pending.values() for call in queue)
    if left:
        raise UnusableHistory(
            f"turn {turn.turn}: calls {left} carry provider ids the turn's record does not have"
        )
    return pairs
