"""What the framework adapters (Pydantic AI, the OpenAI Agents SDK) share when they build a
:class:`~runledger.Flow` from an agent: every tool has a safety class, the lookups name
lookup tools of the agent, and the default prompt.

No SDK is imported here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from runledger.flows import Flow, LookupFn, PolicyContext


def check_safety(tools: Iterable[str], safety: Mapping[str, Any]) -> None:
    """``ValueError`` unless ``safety`` gives a class to exactly the agent's ``tools``."""
    names = set(tools)
    missing = sorted(names - set(safety))
    if missing:
        raise ValueError(
            f"agent tools without a safety class: {', '.join(missing)} "
            f"(pass safety={{{missing[0]!r}: 'idempotent' | 'lookup' | 'read_only' | 'unsafe'}})"
        )
    unknown = sorted(set(safety) - names)
    if unknown:
        raise ValueError(f"safety names tools the agent does not have: {', '.join(unknown)}")


def attach_lookups(flow: Flow, lookups: Mapping[str, LookupFn] | None) -> None:
    """Register each lookup on its tool (``TypeError`` unless the tool is ``lookup``)."""
    for tool_name, fn in (lookups or {}).items():
        if tool_name not in flow.tools:
            raise ValueError(f"lookups names a tool the agent does not have: {tool_name}")
        flow.tools[tool_name].lookup(fn)


def default_prompt(ctx: PolicyContext) -> Any:
    """The run input's ``prompt``."""
    try:
        return ctx.input["prompt"]
    except KeyError:
        raise ValueError("the run input has no 'prompt': pass agent_flow(prompt=...)") from None
