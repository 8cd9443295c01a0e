"""The worker's fast path: a run of 3 turns of 3 calls, then the final decision, is 14
write transactions in the protocol's order and no read after the claim; the journal it
keeps in memory is the one the database holds."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from runledger.db.rows import as_stored
from runledger.flows import Flow, ToolCall
from tests.integration.conftest import Db, Recorder, StartWorker, eventually

TURNS, CALLS = 3, 3


def _agent(rec: Recorder, result: Any) -> Flow:
    flow = Flow("fast", "1")

    @flow.tool(safety="idempotent")
    async def step(ctx: Any, i: int, meta: dict[str, Any]) -> Any:
        rec.tool(ctx)
        return result

    @flow.policy
    async def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        if ctx.turn >= TURNS:
            return []
        # args whose keys jsonb orders otherwise, and a float it keeps as an integer
        return [
            ToolCall("step", {"meta": {"zz": 1, "a": [1.5, 1e100]}, "i": i}) for i in range(CALLS)
        ]

    return flow


async def _transactions(db: Db, run_id: str) -> list[list[str]]:
    """The run's events grouped by the transaction that wrote them, in order."""
    rows = await db.rows(
        "SELECT xmin::text AS tx, kind FROM runledger.run_events WHERE run_id = %s"
        " ORDER BY event_id",
        run_id,
    )
    grouped: list[list[str]] = []
    last = None
    for r in rows:
        if r["tx"] != last:
            grouped.append([])
            last = r["tx"]
        grouped[-1].append(r["kind"])
    return grouped


async def test_a_run_of_three_turns_of_three_calls_is_fourteen_commits(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _agent(rec, {"ok": True})
    worker = await start_worker(flow)
    store = worker.worker.store
    assert store is not None
    reads: list[str] = []
    for name in ("load_journal", "list_calls"):  # the worker store's reads (no get_run)
        real = getattr(store, name)

        def counting(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            reads.append(_name)
            return _real(*args, **kw)

        setattr(store, name, counting)
    await db.submit("fast-1", flow)
    run = await db.wait_status("fast-1", "succeeded", "failed", "paused")

    assert run["status"] == "succeeded"
    assert run["result"] == {"turns": TURNS + 1, "calls": TURNS * CALLS}
    assert (run["state"], run["state_version"]) == ({"completed_turns": TURNS}, TURNS)
    # the decision and its first call's dispatch are one commit (record_turn_v4)
    rest_of_turn = [
        ["call_succeeded", "call_dispatched"],
        ["call_succeeded", "call_dispatched"],
        ["call_succeeded"],
    ]
    assert await _transactions(db, "fast-1") == [
        ["submitted"],
        ["claimed"],
        ["turn_recorded", "call_dispatched"],
        *rest_of_turn,
        ["checkpoint", "turn_recorded", "call_dispatched"],
        *rest_of_turn,
        ["checkpoint", "turn_recorded", "call_dispatched"],
        *rest_of_turn,
        ["checkpoint", "turn_recorded", "run_succeeded"],
    ]  # 14 of the worker's: the claim, 4 per turn, the final decision
    assert reads == []  # the journal came with the claim and stayed in memory
    assert [(k, a) for _, k, a, _ in rec.tool_calls] == [
        (f"fast-1:{t}:c{i}", 1) for t in range(TURNS) for i in range(CALLS)
    ]
    calls = await db.calls("fast-1")
    assert {(c["status"], c["attempts"], c["dispatched_token"]) for c in calls} == {
        ("succeeded", 1, 1)
    }


async def test_a_parallel_group_is_dispatched_with_its_decision(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = Flow("fast-par", "1", parallel_calls=True)

    @flow.tool(safety="idempotent")
    async def fetch(ctx: Any, i: int) -> int:
        rec.tool(ctx)
        return i

    @flow.tool(safety="idempotent", parallel=False)
    async def alone(ctx: Any) -> str:
        rec.tool(ctx)
        return "alone"

    @flow.policy
    async def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        if ctx.turn == 0:  # a group of three, then one that runs alone
            return [*(ToolCall("fetch", {"i": i}) for i in range(3)), ToolCall("alone", {})]
        if ctx.turn == 1:  # one that runs alone first: it goes with the decision alone
            return [ToolCall("alone", {}), ToolCall("fetch", {"i": 9})]
        return []

    await start_worker(flow)
    await db.submit("par-1", flow)
    run = await db.wait_status("par-1", "succeeded", "failed", "paused")
    assert run["status"] == "succeeded"
    txs = await _transactions(db, "par-1")
    assert txs[2] == ["turn_recorded", *["call_dispatched"] * 3]
    assert txs[3:] == [
        # the group's results, ready together, are one commit (complete_calls, 0018)
        ["call_succeeded"] * 3,
        ["call_dispatched"],  # a group's results carry no dispatch: the next runs alone
        ["call_succeeded"],
        ["checkpoint", "turn_recorded", "call_dispatched"],  # a call alone goes alone
        ["call_succeeded", "call_dispatched"],
        ["call_succeeded"],
        ["checkpoint", "turn_recorded", "run_succeeded"],
    ]
    calls = await db.calls("par-1")
    assert {(c["status"], c["attempts"]) for c in calls} == {("succeeded", 1)}
    assert len(rec.tool_calls) == 6


def _history_as_json(history: list[Any]) -> str:
    return json.dumps(
        [
            {
                "turn": t.turn,
                "record": t.record,
                "calls": [
                    [c.call_id, c.tool, c.args, c.status, c.result, c.error, c.provider_id]
                    for c in t.calls
                ],
            }
            for t in history
        ]
    )


async def test_the_journal_in_memory_is_the_one_in_the_database(
    db: Db, start_worker: StartWorker
) -> None:
    """What the policy saw of turns recorded and calls completed in this lease equals,
    key order and number types included, what it sees of them after a reload (a second
    run of the same flow claimed with that journal by a fresh worker sees the same)."""
    result = {"zeta": [1, {"b": 2, "a": 1}], "a": (1, 2.0, 1e100), "éé": None, "bb": -0.5}
    rec = Recorder()
    flow = _agent(rec, result)
    await start_worker(flow)
    await db.submit("mem-1", flow)
    assert (await db.wait_status("mem-1", "succeeded", "failed"))["status"] == "succeeded"

    seen = _history_as_json(rec.histories[TURNS])  # the final decision's history, live
    [final] = await db.rows(
        "SELECT coalesce(json_agg(c ORDER BY c.turn, c.position), '[]'::json) AS calls"
        " FROM runledger.run_calls c WHERE c.run_id = 'mem-1'"
    )
    from_db = [
        {
            "turn": t,
            "record": None,
            "calls": [
                [c["call_id"], c["tool"], c["args"], c["status"], c["result"], c["error"], None]
                for c in final["calls"]
                if c["turn"] == t
            ],
        }
        for t in range(TURNS)
    ]
    assert seen == json.dumps(from_db)
    assert json.dumps(as_stored(result)) == json.dumps(final["calls"][0]["result"])
    assert list(final["calls"][0]["args"]) == ["i", "meta"]  # jsonb's order, not the call's


async def test_a_draining_worker_completes_the_call_alone_and_sends_no_next(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = Flow("drain-fast", "1")
    worker_box: list[Any] = []

    @flow.tool(safety="idempotent")
    async def step(ctx: Any) -> int:
        rec.tool(ctx)
        worker = worker_box[0].worker
        worker_box[0].request_stop()  # the drain starts while the first call runs
        await eventually(lambda: worker.active[ctx.run_id].draining, what="draining")
        return 1

    @flow.policy
    async def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        return [] if history else [ToolCall("step", {}), ToolCall("step", {})]

    w = await start_worker(flow, grace_seconds=10.0)
    worker_box.append(w)
    await db.submit("drain-f", flow)
    await eventually(lambda: w.task.done(), what="worker stopped")
    run = await db.run("drain-f")
    # the first call's result did not carry the second's dispatch: the drain came first
    assert [k for _, k, _, _ in rec.tool_calls] == ["drain-f:0:c0"]
    assert (run["status"], run["state_version"]) == ("queued", 0)
    written = await _transactions(db, "drain-f")
    assert written[:5] == [
        ["submitted"],
        ["claimed"],
        ["turn_recorded", "call_dispatched"],  # the decision and its first call's dispatch
        ["call_succeeded"],
        ["lease_released"],
    ]
    # a poll's claim that was in flight when the stop came (the database ran it after
    # the release, on a loaded machine) gets the run again, and hands it back at once:
    # nothing else
    assert written[5:] == [["claimed"], ["lease_released"]] * (len(written[5:]) // 2)


async def test_results_that_arrive_during_a_commit_go_in_the_next_one(
    db: Db, start_worker: StartWorker
) -> None:
    """Group commit waits for nothing: c0's result is committed alone at once; c1 and
    c2 return while that commit is in flight, and their results are the next commit."""
    flow = Flow("fast-gc", "1", parallel_calls=True)
    first_in_flight = asyncio.Event()

    @flow.tool(safety="idempotent")
    async def fetch(ctx: Any, i: int) -> int:
        if i:
            await first_in_flight.wait()
        return i

    @flow.policy
    async def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        return [] if ctx.turn else [ToolCall("fetch", {"i": i}) for i in range(3)]

    worker = await start_worker(flow)
    store = worker.worker.store
    assert store is not None
    real = store.complete_checked  # a result committed alone
    sent: list[str] = []

    async def held(run_id: str, lease_id: Any, token: int, checked: Any) -> None:
        sent.append(checked[0])
        first_in_flight.set()  # c1 and c2 return now: their results queue behind this one
        queued = worker.worker.executor.writes._queued
        await eventually(lambda: len(queued.get((run_id, token), [])) == 2, what="c1 and c2 queued")
        await real(run_id, lease_id, token, checked)

    store.complete_checked = held  # type: ignore[method-assign]
    await db.submit("gc-1", flow)
    run = await db.wait_status("gc-1", "succeeded", "failed", "paused")
    assert run["status"] == "succeeded"
    assert sent == ["gc-1:0:c0"]  # the one result that went alone
    txs = await _transactions(db, "gc-1")
    assert txs[2:] == [
        ["turn_recorded", *["call_dispatched"] * 3],
        ["call_succeeded"],  # c0, at once
        ["call_succeeded", "call_succeeded"],  # c1 and c2: the next commit
        ["checkpoint", "turn_recorded", "run_succeeded"],
    ]
    calls = await db.calls("gc-1")
    assert [(c["call_id"], c["status"], c["result"]) for c in calls] == [
        ("c0", "succeeded", 0),
        ("c1", "succeeded", 1),
        ("c2", "succeeded", 2),
    ]


async def test_a_group_larger_than_a_batch_commits_in_batches(
    db: Db, start_worker: StartWorker
) -> None:
    """complete_calls takes at most 100 calls: 150 results ready together are two or
    more commits, none over 100, and the run goes on with the one lease."""
    flow = Flow("fast-big", "1", parallel_calls=True)

    @flow.tool(safety="idempotent")
    async def fetch(ctx: Any, i: int) -> int:
        return i

    @flow.policy
    async def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        return [] if ctx.turn else [ToolCall("fetch", {"i": i}) for i in range(150)]

    await start_worker(flow)
    await db.submit("big-1", flow)
    run = await db.wait_status("big-1", "succeeded", "failed", "paused")
    assert run["status"] == "succeeded", run
    events = await db.events("big-1")
    assert [e["kind"] for e in events].count("claimed") == 1
    results = [t for t in await _transactions(db, "big-1") if "call_succeeded" in t]
    assert sum(len(t) for t in results) == 150
    assert max(len(t) for t in results) == 100  # the first 100 that were ready, together
    calls = await db.calls("big-1")
    assert sorted(c["result"] for c in calls) == list(range(150))
