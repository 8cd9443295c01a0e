"""What the bare-SDK helpers share: the prompt before the first turn, and pairing each
of a record's tool-call ids with the call of the history that carries it.

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
