"""A bare client of runledger's contract: the statements a worker at concurrency 1 sends
for the peer flow, from one connection, with nothing of the worker around them (no tool,
no journal in memory, no checks, no tasks). ``peers.py --systems runledger-sql`` runs
it in place of the worker processes: the time it takes is the floor the contract's SQL
puts under the worker on that machine.

    python -m peers.rl_sql_client DATABASE_URL CLIENT_ID

Per run, as the worker sends them (bench/sql_instructions.py sends the same): per turn
``record_turn_v4`` (the checkpoint of the turn before it, the decision of 3 calls, the
dispatch of the first), ``complete_call_v2`` twice (a result and the next call's
dispatch), ``complete_call``; then ``finish_and_claim`` (the final decision and the next
claim). Each is its own autocommit transaction, prepared once and sent through
``runledger.db.wire``, the worker's own path. When nothing is claimable it polls the
claim every 50 ms, until SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import signal
import sys
from typing import Any

import psycopg
import uvloop
from psycopg.types.json import Jsonb

from runledger.db import decode, wire
from runledger.db.statements import (
    CLAIM_RUNS,
    COMPLETE_AND_DISPATCH,
    COMPLETE_CALL,
    FINISH_AND_CLAIM,
    RECORD_TURN,
)

from peers.rl_flow import CALLS_PER_TURN, TURNS

FLOWS = ["peers-agent@1"]
LEASE = dt.timedelta(seconds=30)


def _json(value: Any) -> Jsonb | None:
    return None if value is None else Jsonb(value)


async def _run(conn: psycopg.AsyncConnection[Any], claim: dict[str, Any], worker: str) -> Any:
    """One claimed run to its end; returns the next claim's row."""
    run_id, lease_id, token = claim["run_id"], claim["lease_id"], claim["fencing_token"]
    lease = (run_id, lease_id, token)
    version = claim["state_version"]
    state: dict[str, Any] | None = None
    calls = [{"call_id": f"c{i}", "tool": "noop", "args": {"i": i}} for i in range(CALLS_PER_TURN)]
    for turn in range(TURNS):
        rows = await wire.execute(
            conn,
            RECORD_TURN,
            (*lease, turn, Jsonb(calls), None, None, version, _json(state), False, ["c0"]),
        )
        version = rows[0]["state_version"]
        for i in range(CALLS_PER_TURN):
            key = f"{run_id}:{turn}:c{i}"
            result = Jsonb({"ok": True, "i": i})
            if i + 1 < CALLS_PER_TURN:
                next_key = f"{run_id}:{turn}:c{i + 1}"
                params = (*lease, key, "succeeded", result, None, next_key)
                await wire.execute(conn, COMPLETE_AND_DISPATCH, params)
            else:
                await wire.execute(conn, COMPLETE_CALL, (*lease, key, "succeeded", result, None))
        state = {"completed_turns": turn + 1}
    rows = await wire.execute(
        conn,
        FINISH_AND_CLAIM,
        (*lease, TURNS, None, None, version, _json(state), worker, FLOWS, LEASE, 1),
    )
    return rows[0]


async def main(url: str, client_id: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    worker = f"sql-{client_id}"
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await decode.configure(conn)
        claim: dict[str, Any] | None = None
        while not stop.is_set():
            if claim is None or claim["run_id"] is None:
                rows = await wire.execute(conn, CLAIM_RUNS, (worker, FLOWS, LEASE, 1))
                claim = rows[0] if rows else None
                if claim is None:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.05):
                            await stop.wait()
                    continue
            claim = await _run(conn, claim, worker)


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1], sys.argv[2]))
