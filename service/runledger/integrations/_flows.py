"""What the framework adapters (Pydantic AI, the OpenAI Agents SDK) share when they build a
:class:`~runledger.Flow` from an agent: every tool has a safety class, the lookups name
lookup tools of the agent, the default prompt, and the check of what an adapter assumes
of its framework's public API.

No SDK is imported here.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
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


class FrameworkMismatch(RuntimeError):
    """The installed version of a framework lacks something its runledger adapter uses
    (a public hook removed, or its signature changed): raised when a flow is built, naming
    the framework's version, rather than failing in the middle of a run."""


Need = tuple[str, Callable[[], object]]
"""What an adapter needs, in words, and a check of it (false, or raising: not there)."""


def unmet(needs: Iterable[Need]) -> list[str]:
    """The needs whose check fails."""
    out = []
    for what, check in needs:
        try:
            ok = bool(check())
        except Exception:
            ok = False
        if not ok:
            out.append(what)
    return out


def require(adapter: str, distribution: str, needs: Iterable[Need]) -> None:
    """``FrameworkMismatch`` naming ``distribution``'s installed version unless every
    need holds."""
    missing = unmet(needs)
    if missing:
        raise FrameworkMismatch(mismatch(adapter, distribution, missing))


def mismatch(adapter: str, distribution: str, missing: list[str]) -> str:
    try:
        installed = f"{distribution} {metadata.version(distribution)}"
    except metadata.PackageNotFoundError:
        installed = f"the installed {distribution}"
    return (
        f"runledger's {adapter} adapter needs {'; '.join(missing)}; {installed} does not have "
        f"{'it' if len(missing) == 1 else 'them'}"
    )


def takes(fn: Callable[..., Any], *names: str) -> bool:
    """``fn`` takes parameters of these names."""
    parameters = inspect.signature(fn).parameters
    return all(name in parameters for name in names)


def has_fields(cls: type, *names: str) -> bool:
    """The dataclass ``cls`` has fields of these names."""
    fields = {f.name for f in dataclasses.fields(cls)}
    return all(name in fields for name in names)
