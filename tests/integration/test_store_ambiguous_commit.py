"""A connection lost during COMMIT leaves the outcome unknown: the store reads the row
back and neither repeats a write that landed nor gives up on one that did not.

The fault is injected at the client boundary (the statement really runs on the real
database, then the client is told the connection dropped).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest

from runledger.db.store import Store


class FlakyStore(Store):
    """Fails the first statement that starts with ``prefix``: after running it
    (``landed=True``, a lost COMMIT acknowledgement) or before (``landed=False``)."""

    def __init__(self, pool: Any, prefix: str, landed: bool) -> None:
        super().__init__(pool, backoff=0.01)
        self.prefix = prefix
        self.landed = landed
        self.sent: list[str] = []

    async def _rows(self, sql: Any, params: Sequence[Any]) -> list[dict[str, Any]]:
        text = str(sql)
        self.sent.append(text)
        if self.prefix and text.startswith(self.prefix):
            self.prefix = ""
            if self.landed:
                await super()._rows(sql, params)
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return await super()._rows(sql, params)


async def _leased(store: Store) -> Any:
    await store.submit_run("amb-1", "demo", "1", {"x": 1})
    (claim,) = await store.claim_runs("w1", ["demo@1"], dt.timedelta(seconds=60), 1)
    await store.record_turn(
        claim.run_id,
        claim.lease_id,
        claim.fencing_token,
        0,
        [{"call_id": "c1", "tool": "t", "args": {}}],
    )
    return claim


@pytest.mark.parametrize("landed", [True, False])
async def test_dispatch_is_not_repeated_after_a_lost_commit(
    store: Store, landed: bool, admin_conn: psycopg.Connection[Any]
) -> None:
    claim = await _leased(store)
    flaky = FlakyStore(store.pool, "SELECT runledger.dispatch_call", landed)
    attempt = await flaky.dispatch_call(
        claim.run_id, claim.lease_id, claim.fencing_token, "amb-1:0:c1"
    )
    assert attempt == 1
    row = admin_conn.execute(
        "SELECT status, attempts FROM runledger.run_calls WHERE idempotency_key = 'amb-1:0:c1'"
    ).fetchone()
    assert row == ("dispatched", 1)
    sends = [s for s in flaky.sent if s.startswith("SELECT runledger.dispatch_call")]
    assert len(sends) == (1 if landed else 2)  # landed: read back, not sent again


@pytest.mark.parametrize("landed", [True, False])
async def test_complete_checkpoint_finish_survive_lost_commits(
    store: Store, landed: bool, admin_conn: psycopg.Connection[Any]
) -> None:
    claim = await _leased(store)
    args = (claim.run_id, claim.lease_id, claim.fencing_token)
    await store.dispatch_call(*args, "amb-1:0:c1")

    flaky = FlakyStore(store.pool, "SELECT runledger.complete_call", landed)
    await flaky.complete_call(*args, "amb-1:0:c1", "succeeded", {"ok": 1}, {"id": 9})
    flaky = FlakyStore(store.pool, "SELECT runledger.checkpoint", landed)
    assert await flaky.checkpoint(*args, 0, {"turn": 1}) == 1  # no VersionConflict
    flaky = FlakyStore(store.pool, "SELECT runledger.finish_run", landed)
    await flaky.finish_run(*args, "succeeded", {"done": True}, None)

    run = admin_conn.execute(
        "SELECT status, state_version, state, lease_id FROM runledger.runs WHERE run_id = 'amb-1'"
    ).fetchone()
    assert run == ("succeeded", 1, {"turn": 1}, None)
    kinds = [
        r[0]
        for r in admin_conn.execute(
            "SELECT kind FROM runledger.run_events WHERE run_id = 'amb-1' ORDER BY event_id"
        )
    ]
    assert kinds.count("call_succeeded") == 1
    assert kinds.count("checkpoint") == 1
    assert kinds.count("run_succeeded") == 1
