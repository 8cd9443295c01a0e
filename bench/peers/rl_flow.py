"""The runledger flow of the peer benchmark: 3 turns x 3 no-op async tools, then an
empty decision. Workers load it with ``--flows peers.rl_flow:flow``. With
``PEERS_RL_PARALLEL=1`` in the environment (``peers.py --rl-parallel``) each turn's
calls run in parallel, as one group."""

from __future__ import annotations

import os
from typing import Any

from runledger.flows import Flow, HistoryTurn, PolicyContext, ToolCall, ToolContext

TURNS = 3
CALLS_PER_TURN = 3

flow = Flow("peers-agent", version="1", parallel_calls=os.environ.get("PEERS_RL_PARALLEL") == "1")


@flow.tool(safety="idempotent")
async def noop(ctx: ToolContext, i: int = 0) -> dict[str, Any]:
    return {"ok": True, "i": i}


@flow.policy
async def policy(ctx: PolicyContext, history: list[HistoryTurn]) -> list[ToolCall]:
    if ctx.turn >= TURNS:
        return []  # the empty decision: the run succeeds
    return [ToolCall("noop", {"i": i}) for i in range(CALLS_PER_TURN)]
