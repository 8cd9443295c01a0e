"""Human approval, end to end: a worker in-process, a person deciding through the CLI (in
process, as ``runledger.cli.main``) or the Client, against a fresh database.

A call that needs approval is recorded before the run pauses, and the tool is invoked
zero times until a person approves it; approved, it runs exactly once; denied, it never
runs and the policy sees a failed call whose error says ``denied``.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest
from click.testing import CliRunner, Result

from runledger import cli
from runledger.client import Client
from runledger.flows import Flow, HistoryTurn, ToolCall
from runledger.worker.runs import awaiting_approval_reason, pause_reason
from tests.integration.conftest import Db, Recorder, StartWorker


async def _cli(database_url: str, *args: str) -> Result:
    """``runledger ARGS`` in process, in a thread: the worker of this loop keeps running."""

    def invoke() -> Result:
        return CliRunner().invoke(
            cli.main,
            list(args),
            env={"RUNLEDGER_DATABASE_URL": database_url, "USER": "carol", "COLUMNS": "80"},
        )

    return await asyncio.to_thread(invoke)


def _payments(rec: Recorder, *, declared: bool = True, parallel: bool = False) -> Flow:
    """Turn 0: look two things up and pay (``pay`` needs approval: declared on the tool, or
    asked for by the policy with ``ToolCall(..., approval=True)``); then end the run with
    what the policy saw of the payment."""
    flow = Flow("payments", "1", parallel_calls=parallel)

    @flow.tool(safety="idempotent")
    def lookup(ctx: Any, what: str) -> dict[str, Any]:
        rec.tool(ctx)
        return {"found": what}

    @flow.tool(safety="unsafe", approval=declared)
    def pay(ctx: Any, amount: int) -> dict[str, Any]:
        rec.tool(ctx)
        return {"paid": amount}

    @flow.policy
    def decide(ctx: Any, history: list[HistoryTurn]) -> Any:
        rec.policy(ctx, history)
        if not history:
            return [
                ToolCall("lookup", {"what": "invoice"}),
                ToolCall("pay", {"amount": 40}, approval=not declared),
                ToolCall("lookup", {"what": "customer"}),
            ]
        [paid] = [c for c in history[0].calls if c.tool == "pay"]
        from runledger.flows import Decision

        return Decision(output={"pay": paid.status, "approval": paid.approval, "error": paid.error})

    return flow


async def test_a_call_awaiting_approval_pauses_the_run_before_the_tool_runs_then_runs_once(
    database_url: str, db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _payments(rec)
    await start_worker(flow)
    await db.submit("pay-1", flow)
    paused = await db.wait_status("pay-1", "paused", "succeeded", "failed")
    key = "pay-1:0:c1"

    # serial: the first lookup ran, then the run paused on the payment; nothing after it ran
    assert rec.calls_of("pay") == []
    assert [c[1] for c in rec.tool_calls] == ["pay-1:0:c0"]
    assert paused["status"] == "paused"
    assert paused["pause_reason"] == awaiting_approval_reason(key)
    calls = {c["idempotency_key"]: c for c in await db.calls("pay-1")}
    assert (calls[key]["status"], calls[key]["approval"], calls[key]["attempts"]) == (
        "planned",
        "pending",
        0,
    )
    assert [c["approval"] for c in calls.values()] == [None, "pending", None]
    [turn] = await db.turns("pay-1")
    assert turn["calls"][1] == {
        "call_id": "c1",
        "tool": "pay",
        "args": {"amount": 40},
        "approval": True,
    }

    # status shows the payment awaiting approval and the two lines to choose from, whole
    status = await _cli(database_url, "status", "pay-1")
    assert status.exit_code == 0, status.output
    lines = status.stdout.splitlines()
    assert f"pause reason: {paused['pause_reason']}" in lines
    assert "1 call(s) await approval: run one of the two lines for each" in lines
    assert f"  runledger approve {key}" in lines
    assert f'  runledger deny {key} --reason "..."' in lines
    assert "awaiting" in status.stdout

    approved = await _cli(database_url, "approve", key, "--actor", "dave", "--note", "invoice ok")
    assert approved.exit_code == 0, approved.output
    # the run was queued again (a worker may have taken it already)
    assert approved.stdout in {
        f"{key} approved; run pay-1 is {status}\n" for status in ("queued", "running", "succeeded")
    }, approved.stdout
    done = await db.wait_status("pay-1", "succeeded", "failed", "paused")
    assert done["status"] == "succeeded", done
    assert done["result"] == {"pay": "succeeded", "approval": "approved", "error": None}

    assert [c[1] for c in rec.calls_of("pay")] == [key]  # exactly once
    assert len(rec.calls_of("lookup")) == 2
    [call] = [c for c in await db.calls("pay-1") if c["idempotency_key"] == key]
    assert (call["status"], call["approval"], call["approval_by"], call["approval_note"]) == (
        "succeeded",
        "approved",
        "dave",
        "invoice ok",
    )
    events = await db.events("pay-1")
    kinds = [(e["kind"], e["detail"].get("idempotency_key")) for e in events]
    assert kinds.index(("call_approved", key)) < kinds.index(("call_dispatched", key))
    [approval] = [e for e in events if e["kind"] == "call_approved"]
    assert approval["actor"] == "dave"
    assert [e["detail"] for e in events if e["kind"] == "run_requeued"] == [
        {"after": "approve_call"}
    ]

    # once decided, a call is not decided again: one line, exit 1
    again = await _cli(database_url, "deny", key, "--reason", "too late")
    assert again.exit_code == 1 and "does not await approval" in str(again.exception)


async def test_a_denied_call_never_runs_and_the_policy_sees_the_refusal(
    database_url: str, db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _payments(rec, declared=False)  # the policy asks for the approval
    await start_worker(flow)
    await db.submit("pay-2", flow)
    await db.wait_status("pay-2", "paused")
    key = "pay-2:0:c1"

    def deny() -> None:
        with Client(database_url, actor="client:erin") as client:
            client.deny(key, "the customer disputes the invoice")

    await asyncio.to_thread(deny)
    done = await db.wait_status("pay-2", "succeeded", "failed", "paused")
    assert done["status"] == "succeeded", done

    assert rec.calls_of("pay") == []  # never invoked, before or after the denial
    assert len(rec.calls_of("lookup")) == 2  # the rest of the turn went on
    refusal = {
        "reason": "denied",
        "note": "the customer disputes the invoice",
        "actor": "client:erin",
    }
    assert done["result"] == {"pay": "failed", "approval": "denied", "error": refusal}
    [seen] = [c for c in rec.histories[1][0].calls if c.tool == "pay"]
    assert (seen.status, seen.error, seen.approval, seen.result) == (
        "failed",
        refusal,
        "denied",
        None,
    )
    [call] = [c for c in await db.calls("pay-2") if c["idempotency_key"] == key]
    assert (call["attempts"], call["dispatched_at"]) == (0, None)
    kinds = await db.kinds("pay-2")
    assert "call_denied" in kinds
    assert not [
        e
        for e in await db.events("pay-2", "call_dispatched")
        if e["detail"]["idempotency_key"] == key
    ]


async def test_in_a_parallel_group_the_siblings_run_then_the_run_pauses(
    database_url: str, db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _payments(rec, parallel=True)
    await start_worker(flow)
    await db.submit("pay-3", flow)
    paused = await db.wait_status("pay-3", "paused", "succeeded", "failed")
    key = "pay-3:0:c1"
    assert paused["status"] == "paused"
    assert paused["pause_reason"] == pause_reason("pay-3", [], [key])
    assert rec.calls_of("pay") == []
    assert sorted(c[1] for c in rec.calls_of("lookup")) == ["pay-3:0:c0", "pay-3:0:c2"]
    assert [c["status"] for c in await db.calls("pay-3")] == ["succeeded", "planned", "succeeded"]

    def approve() -> None:
        with Client(database_url) as client:
            client.approve(key)

    await asyncio.to_thread(approve)
    done = await db.wait_status("pay-3", "succeeded", "failed")
    assert done["status"] == "succeeded", done
    assert [c[1] for c in rec.calls_of("pay")] == [key]
    assert len(rec.calls_of("lookup")) == 2  # the settled siblings were not sent again


def test_pause_reasons_name_each_key_and_stay_storable() -> None:
    keys = [f"r:0:c{i}" for i in range(3)]
    assert pause_reason("r", [], keys) == (
        "calls r:0:c0, r:0:c1, r:0:c2 await approval: for each, "
        '`runledger approve <key>` or `runledger deny <key> --reason "..."`'
    )
    both = pause_reason("r", ["r:0:c9"], keys[:1])
    assert both.startswith("call r:0:c9 is unknown: reconcile it with `runledger resolve r:0:c9")
    assert both.endswith(
        "call r:0:c0 awaits approval: `runledger approve r:0:c0` or "
        '`runledger deny r:0:c0 --reason "..."`'
    )
    long = [f"{'r' * 128}:0:c{i}" for i in range(8)]
    short = pause_reason("r" * 128, long[:3], long[3:])
    assert len(short) <= 1000  # what finish_run stores (runledger._cap('reason'))
    assert "3 call(s) are unknown" in short and "5 call(s) await approval" in short
    assert f"`runledger status {'r' * 128}` lists them" in short


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["approve", "nope:0:c0"], 1, "RunNotFound"),
        (["deny", "nope:0:c0", "--reason", "no"], 1, "RunNotFound"),
        (["deny", "nope:0:c0", "--reason", ""], 1, "InvalidInput"),
        (["approve", "nope:0:c0", "--actor", ""], 2, "--actor"),
        (["approve", "nope:0:c0", "--note", "n" * 4001], 1, "InvalidInput"),
        (["deny", "nope:0:c0"], 2, "--reason"),
    ],
)
def test_refusals_are_one_line(
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    code: int,
    message: str,
) -> None:
    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", database_url)
    monkeypatch.delenv("RUNLEDGER_REASON", raising=False)
    monkeypatch.setattr(sys, "argv", ["runledger", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    out, err = capsys.readouterr()
    assert (exit_.value.code, out) == (code, ""), err
    [line] = err.splitlines()
    assert message in line and "Traceback" not in err, line


# -- a decision whose acknowledgement was lost is read back, never sent twice ---------------


@pytest.mark.parametrize("landed", [True, False], ids=["ack-lost", "not-sent"])
@pytest.mark.parametrize("decision", ["approve_call", "deny_call"])
async def test_a_decision_is_read_back_after_a_lost_connection(
    store: Any, admin_conn: Any, decision: str, landed: bool
) -> None:
    from tests.integration.test_store_ambiguous_commit import (
        KEY,
        RUN,
        FlakyStore,
        lease_of,
        leased,
    )

    claim = await leased(store)
    await store.worker.record_turn(
        *lease_of(claim), 0, [{"call_id": "c1", "tool": "t", "approval": True}]
    )
    await store.worker.finish_run(*lease_of(claim), "paused", None, "awaits approval")
    flaky = FlakyStore(store.executor.pool, f"SELECT runledger.{decision}(", landed=landed)
    if decision == "approve_call":
        await flaky.operator.approve_call(KEY, actor="alice", note="ok")
    else:
        await flaky.operator.deny_call(KEY, reason="no", actor="alice")
    sent = [s for s in flaky.sent if s.startswith(f"SELECT runledger.{decision}(")]
    assert len(sent) == (1 if landed else 2)  # read back, not sent again, when it landed
    kind = "call_approved" if decision == "approve_call" else "call_denied"
    found = admin_conn.execute(
        "SELECT count(*) AS n FROM runledger.run_events WHERE run_id = %s AND kind = %s",
        (RUN, kind),
    ).fetchone()
    assert found[0] == 1
    status = admin_conn.execute(
        "SELECT status FROM runledger.runs WHERE run_id = %s", (RUN,)
    ).fetchone()
    assert status[0] == "queued"


async def test_two_calls_awaiting_approval_in_sequence_are_named_together(
    database_url: str, db: Db, start_worker: StartWorker
) -> None:
    """One after another, both needing a person: the pause names both (the run is queued
    again only once both are decided), and approving one says what the run still waits for."""
    rec = Recorder()
    flow = Flow("two-pays", "1")

    @flow.tool(safety="unsafe", approval=True)
    def pay(ctx: Any, amount: int) -> dict[str, Any]:
        rec.tool(ctx)
        return {"paid": amount}

    @flow.policy
    def decide(ctx: Any, history: list[HistoryTurn]) -> Any:
        return [] if history else [ToolCall("pay", {"amount": 1}), ToolCall("pay", {"amount": 2})]

    await start_worker(flow)
    await db.submit("two-1", flow)
    paused = await db.wait_status("two-1", "paused", "succeeded", "failed")
    first, second = "two-1:0:c0", "two-1:0:c1"
    assert paused["pause_reason"] == pause_reason("two-1", [], [first, second])

    approved = await _cli(database_url, "approve", first)
    assert approved.exit_code == 0, approved.output
    assert approved.stdout == (
        f"{first} approved; run two-1 stays paused: {second} still awaits approval "
        "(`runledger status two-1`)\n"
    )
    assert (await db.run("two-1"))["status"] == "paused"
    assert rec.calls_of("pay") == []

    denied = await _cli(database_url, "deny", second, "--reason", "one is enough")
    assert denied.exit_code == 0, denied.output
    done = await db.wait_status("two-1", "succeeded", "failed")
    assert done["status"] == "succeeded", done
    assert [c[1] for c in rec.calls_of("pay")] == [first]
    calls = await db.calls("two-1")
    assert [(c["status"], c["approval"]) for c in calls] == [
        ("succeeded", "approved"),
        ("failed", "denied"),
    ]


async def test_an_empty_note_is_a_note(
    database_url: str, db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    await start_worker(_payments(rec))
    await db.submit("pay-note", _payments(Recorder()))
    await db.wait_status("pay-note", "paused")
    approved = await _cli(database_url, "approve", "pay-note:0:c1", "--note", "")
    assert approved.exit_code == 0, approved.output
    [call] = [c for c in await db.calls("pay-note") if c["tool"] == "pay"]
    assert (call["approval"], call["approval_note"]) == ("approved", "")
