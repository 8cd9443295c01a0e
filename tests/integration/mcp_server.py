"""A tiny MCP server over stdio for the adapter tests, with one tool per kind of annotation.

Run as ``python tests/integration/mcp_server.py LOG``: every call of a tool that changes
something appends one JSON line to ``LOG`` (the tool, its arguments, the server's pid), so
a test can count the effects that reached the server.
"""

from __future__ import annotations

import json
import os
import sys

from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

server = MCPServer("runledger-test")
LOG = sys.argv[1] if len(sys.argv) > 1 else os.devnull


def effect(tool: str, **args: object) -> None:
    with open(LOG, "a", encoding="utf-8") as log:
        log.write(json.dumps({"tool": tool, "args": args, "pid": os.getpid()}) + "\n")


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def get_balance(account: str) -> str:
    """Read an account's balance."""
    return f"{account}: 100"


@server.tool(annotations=ToolAnnotations(idempotent_hint=True, destructive_hint=False))
def set_status(ticket: str, status: str) -> str:
    """Set a ticket's status (the same arguments twice change nothing more)."""
    effect("set_status", ticket=ticket, status=status)
    return f"{ticket} is {status}"


@server.tool(annotations=ToolAnnotations(idempotent_hint=True, destructive_hint=True))
def delete_ticket(ticket: str) -> str:
    """Delete a ticket."""
    effect("delete_ticket", ticket=ticket)
    return f"{ticket} deleted"


@server.tool()
def send_note(text: str) -> str:
    """Send a note (no annotations: nothing is claimed)."""
    effect("send_note", text=text)
    return "sent"


if __name__ == "__main__":
    server.run("stdio")
