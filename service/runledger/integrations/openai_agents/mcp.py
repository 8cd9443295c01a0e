"""The MCP servers of an Agents SDK agent (``agents.mcp.MCPServerStdio`` and the others):
their tools, listed when the flow is built, and a session to each server while a model
request or a call of one of its tools needs it.

The tools are the ``FunctionTool``s ``Agent.get_mcp_tools`` makes (what ``Runner.run``
shows the model: the agent's ``mcp_config`` applies), each with the annotations its
server listed and the server itself. A session is opened by the first request or call
that needs the server and closed by the last one (a stdio server's process lives that
long): the SDK leaves connecting to the caller of ``Runner.run``, and a runledger worker
makes requests and calls of many runs at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from agents import Agent, RunContextWrapper
from agents.mcp import MCPServer
from agents.tool import FunctionTool

from runledger.integrations._mcp import annotations_of, run_aside


@dataclass(frozen=True, slots=True, kw_only=True)
class McpTool:
    """One MCP tool of the agent, as the model is shown it."""

    tool: FunctionTool
    server: MCPServer
    annotations: dict[str, Any] | None


def mcp_tools(agent: Agent[Any]) -> dict[str, McpTool]:
    """Every tool of the agent's MCP servers, listed from the servers now (each connected
    and closed again, on an event loop of its own)."""
    servers = list(agent.mcp_servers)
    for i, server in enumerate(servers):
        if not isinstance(server, MCPServer):
            raise TypeError(
                f"agent {agent.name}: mcp_servers[{i}] is a {type(server).__name__}, "
                "not an agents.mcp.MCPServer"
            )
    if not servers:
        return {}

    async def listed() -> tuple[list[Any], list[tuple[MCPServer, Any]]]:
        wrapper: RunContextWrapper[Any] = RunContextWrapper(context=None)
        async with contextlib.AsyncExitStack() as stack:
            for server in servers:
                await server.connect()  # type: ignore[no-untyped-call]  # the SDK leaves it untyped
                stack.push_async_callback(server.cleanup)
            made = list(await agent.get_mcp_tools(wrapper))
            raw = [(s, t) for s in servers for t in await s.list_tools(wrapper, agent)]
            return made, raw

    names = ", ".join(s.name for s in servers)
    made, raw = run_aside(f"MCP servers {names}: tools not listed", listed)
    if len(made) != len(raw):  # get_all_function_tools makes one tool per listed tool
        raise ValueError(
            f"agent {agent.name}: its MCP servers listed {len(raw)} tools but the SDK made "
            f"{len(made)} of them"
        )
    tools: dict[str, McpTool] = {}
    for tool, (server, listed_tool) in zip(made, raw, strict=True):
        if not isinstance(tool, FunctionTool):
            raise ValueError(f"MCP tool {listed_tool.name} is a {type(tool).__name__}")
        tools[tool.name] = McpTool(
            tool=tool, server=server, annotations=annotations_of(listed_tool.annotations)
        )
    return tools


class Sessions:
    """Shared sessions to MCP servers: :meth:`open` connects a server on its first user
    and closes it after its last (per event loop: a worker has one)."""

    def __init__(self) -> None:
        self._users: dict[int, int] = {}
        self._locks: dict[tuple[int, int], asyncio.Lock] = {}

    def _lock(self, server: MCPServer) -> asyncio.Lock:
        key = (id(asyncio.get_running_loop()), id(server))
        return self._locks.setdefault(key, asyncio.Lock())

    @contextlib.asynccontextmanager
    async def open(self, servers: Iterable[MCPServer]) -> AsyncIterator[None]:
        entered: list[MCPServer] = []
        try:
            for server in servers:
                async with self._lock(server):
                    if self._users.get(id(server), 0) == 0:
                        await server.connect()  # type: ignore[no-untyped-call]  # the SDK leaves it untyped
                    self._users[id(server)] = self._users.get(id(server), 0) + 1
                entered.append(server)
            yield
        finally:
            for server in reversed(entered):
                async with self._lock(server):
                    self._users[id(server)] -= 1
                    if self._users[id(server)] == 0:
                        await server.cleanup()  # type: ignore[no-untyped-call]
