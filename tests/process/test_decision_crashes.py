"""A real worker SIGKILLs itself around the model's decision; a second one recovers.

- ``after_decide``: the policy answered and nothing of the decision is journaled. The
  next worker asks the policy again, and each tool effect still happens exactly once.
- ``after_record_turn``: the decision is committed. The next worker never asks the
  policy again for that turn: it replays the journaled decision (its record included)
  and runs each tool effect exactly once; for the final decision, the journaled output
  becomes the run's result.

The flow is ``tests/process/decision_flows.py``; the first worker's lease is expired
with the fake database clock.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.process.conftest import LEASE, call_rows, events, run_row, wait_status

pytestmark = pytest.mark.process

FLOWS = ["tests.process.decision_flows:flows"]


def asks_of(path: Path) -> list[int]:
    return [int(x) for x in path.read_text(encoding="utf-8").split()] if path.exists() else []


def turns(conn: Any, run_id: str) -> list[dict[str, Any]]:
    cur = conn.execute(
        "SELECT turn, calls, record, output, fencing_token FROM runledger.run_turns"
        " WHERE run_id = %s ORDER BY turn",
        (run_id,),
    )
    names = [d.name for d in cur.description or []]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


@pytest.mark.parametrize(
    ("point", "turn", "asks", "journaled_by"),
    [
        # the model answered turn 0, nothing journaled: asked again, the second answer is kept
        ("after_decide", 0, [0, 0, 1], 2),
        # turn 0 journaled: never asked again for it
        ("after_record_turn", 0, [0, 1], 1),
        # the final answer, not journaled: asked again
        ("after_decide", 1, [0, 1, 1], 2),
        # the final decision journaled: its output is the result, the model is not asked
        ("after_record_turn", 1, [0, 1], 1),
    ],
    ids=["after_decide-0", "after_record_turn-0", "after_decide-final", "after_record_turn-final"],
)
def test_crash_around_the_decision(
    point: str,
    turn: int,
    asks: list[int],
    journaled_by: int,
    workers: Any,
    provider: Any,
    admin_conn: Any,
    db_clock: Any,
    lease_args: list[str],
    tmp_path: Path,
) -> None:
    from psycopg.types.json import Jsonb

    workers.flows = list(FLOWS)
    run_id = f"dec-{point}-{turn}"
    side = tmp_path / "asks"
    admin_conn.execute(
        "SELECT * FROM runledger.submit_run(%s, 'decider', '1', %s)",
        (run_id, Jsonb({"asks": str(side)})),
    )

    (first,) = workers.start(1, env={"RUNLEDGER_CRASH_AT": f"{point}:{turn}"}, args=lease_args)
    assert workers.wait(first, timeout=30) == -9, workers.log(first)
    crashed = run_row(admin_conn, run_id)
    assert crashed["status"] == "running" and crashed["fencing_token"] == 1
    recorded = [t["turn"] for t in turns(admin_conn, run_id)]
    # after_decide: the crashed turn is not journaled; after_record_turn: it is
    assert recorded == list(range(turn + (1 if point == "after_record_turn" else 0)))
    asked_before = asks_of(side)
    assert asked_before == list(range(turn + 1)), asked_before

    db_clock.advance(LEASE + 1)
    (second,) = workers.start(1, args=lease_args)
    final = wait_status(admin_conn, run_id, ("succeeded", "paused", "failed"))
    assert final["status"] == "succeeded", (
        final,
        call_rows(admin_conn, run_id),
        workers.log(second),
    )

    # how often the model was asked, turn by turn
    assert asks_of(side) == asks
    journal = turns(admin_conn, run_id)
    assert [t["turn"] for t in journal] == [0, 1]
    # one decision row per turn, with the record of the answer that was journaled
    crashed_turn = journal[turn]
    assert crashed_turn["record"]["ask"] == journaled_by
    assert crashed_turn["fencing_token"] == (1 if point == "after_record_turn" else 2)
    # each tool effect exactly once, by runledger's keys (never the provider's ids)
    calls = call_rows(admin_conn, run_id)
    assert [(c["idempotency_key"], c["status"], c["attempts"]) for c in calls] == [
        (f"{run_id}:0:c0", "succeeded", 1),
        (f"{run_id}:0:c1", "succeeded", 1),
    ]
    for c in calls:
        assert len(provider.client.effects(c["idempotency_key"])) == 1
    # the final decision's output is the run's result; it saw turn 0's journaled record
    result = admin_conn.execute(
        "SELECT result FROM runledger.runs WHERE run_id = %s", (run_id,)
    ).fetchone()[0]
    ticket_id = calls[0]["result"]["ticket_id"]
    assert result == {
        "ticket_id": ticket_id,
        "ask": journal[1]["record"]["ask"],
        "seen_record": journal[0]["record"],
    }
    assert journal[1]["output"] == result
    assert len(events(admin_conn, run_id, "turn_recorded")) == 2
    takeover = events(admin_conn, run_id, "takeover")
    assert takeover and takeover[0]["fencing_token"] == 2
