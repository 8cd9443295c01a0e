"""Safety classes of MCP tools from their annotations, for the framework adapters.

An MCP server describes each tool with *hints* (``readOnlyHint``, ``idempotentHint``,
``destructiveHint``, ``openWorldHint``). The MCP specification says they are hints, "not
guaranteed to provide a faithful description of tool behavior", and that clients should
never decide on them for a server they do not trust. A flow's ``safety={...}`` always
wins; a tool it does not name gets its class from :func:`hinted_safety`:

- ``readOnlyHint: true`` is ``read_only``: the hint says what runledger's class means (a
  call runs again after a crash and nothing changes).
- ``idempotentHint: true`` with ``destructiveHint: false`` is ``idempotent``, and only
  when the flow passes ``trust_mcp_hints=True``. MCP's idempotence is "the same arguments
  again have no additional effect"; runledger's ``idempotent`` sends a call found in
  flight again, counting on the provider to take the same *key* once. The two agree only
  while nothing else changed what the call touches in between; a destructive idempotent
  tool (a delete) may then destroy what another actor made since. So the hint is used
  only when the flow says it trusts the server, and never for a destructive tool.
- anything else, no annotations included, is ``unsafe``: a call found in flight is
  ``unknown`` and the run pauses for a person (the conservative default).

No SDK is imported here.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any, TypeVar

from runledger.integrations._flows import check_safety
from runledger.model import Safety

T = TypeVar("T")

_HINTS = ("readOnlyHint", "idempotentHint", "destructiveHint", "openWorldHint")


class McpToolsUnavailable(RuntimeError):
    """The tools of an agent's MCP server could not be listed when its flow was built (the
    server did not start, or did not answer): one line naming the server and the error."""


def annotations_of(value: Any) -> dict[str, Any] | None:
    """An MCP tool's annotations as the wire's camelCase mapping (None: it has none):
    from a mapping, or from the ``mcp`` package's ``ToolAnnotations`` model."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return dict(value)
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        dumped = dump(by_alias=True)
        if isinstance(dumped, Mapping):
            return dict(dumped)
    raise TypeError(f"MCP tool annotations must be a mapping, got {type(value).__name__}")


def hinted_safety(annotations: Mapping[str, Any] | None, *, trust: bool = False) -> Safety:
    """The safety class of an MCP tool that the flow does not name, from its annotations
    (see the module's docstring). A hint counts only when it is exactly ``true`` or
    ``false``: anything else is no hint."""
    hints = {k: (annotations or {}).get(k) for k in _HINTS}
    if hints["readOnlyHint"] is True:
        return Safety.READ_ONLY
    if trust and hints["idempotentHint"] is True and hints["destructiveHint"] is False:
        return Safety.IDEMPOTENT
    return Safety.UNSAFE


def resolve_safety(
    tools: Iterable[str],
    mcp_tools: Mapping[str, Mapping[str, Any] | None],
    safety: Mapping[str, Safety | str],
    *,
    trust_mcp_hints: bool,
) -> dict[str, Safety | str]:
    """The safety class of every tool of an agent: ``safety``'s entry when it has one (a
    function tool must have one); else, for an MCP tool, the class its annotations give
    (``mcp_tools``: name -> annotations). ``ValueError`` for a function tool without a
    class or a class for a tool the agent lacks, ``TypeError`` for a non-bool
    ``trust_mcp_hints``."""
    if not isinstance(trust_mcp_hints, bool):
        raise TypeError(f"trust_mcp_hints must be True or False, got {trust_mcp_hints!r}")
    function_tools = list(tools)
    both = sorted(set(function_tools) & set(mcp_tools))
    if both:
        raise ValueError(f"an MCP server's tool has the name of a function tool: {both[0]}")
    named = {name: cls for name, cls in safety.items() if name in mcp_tools}
    check_safety(function_tools, {k: v for k, v in safety.items() if k not in mcp_tools})
    out: dict[str, Safety | str] = {name: safety[name] for name in function_tools}
    for name, hints in mcp_tools.items():
        out[name] = named[name] if name in named else hinted_safety(hints, trust=trust_mcp_hints)
    return out


def run_aside(what: str, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``make()`` to completion on an event loop of its own, in a thread of its own
    (a flow is built at import, or inside a running loop: an in-process worker's test).
    Whatever it raises is :class:`McpToolsUnavailable` naming ``what``."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = asyncio.run(make())
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=target, name="runledger-mcp-list", daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise McpToolsUnavailable(f"{what}: {one_line(out['error'])}") from None
    value: T = out["value"]
    return value


def one_line(exc: BaseException) -> str:
    """``Type: message`` of the innermost first exception of a group, on one line."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    said = " ".join(str(exc).split())
    return f"{type(exc).__name__}{': ' + said if said else ''}"
