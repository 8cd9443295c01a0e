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

from runledger.integrations._history import UnusableHistory
from runledger.integrations.openai._shared import InvalidToolArguments, UnsupportedToolCall
from runledger.integrations.openai.chat import (
    decision_from_chat_completion,
    messages_from_history,
    openai_chat_policy,
)
from runledger.integrations.openai.responses import (
    decision_from_response,
    input_from_history,
    openai_responses_policy,
)

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
